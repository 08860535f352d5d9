"""Where a request's time goes, through real servers and the router: the stage breakdown an answer
carries when asked ("return_timings"), the router's request log line, each server's stage histograms
(router/timings.py, decode/timings.py, common/serving/server_metrics.py), and one OpenTelemetry trace
across the three processes (common/tracing.py), received by an OTLP receiver in this process."""

import json
import os
import pathlib
import re
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from pdserve.bench.micro.otlp_sink import start_receiver
from pdserve.common.ports import free_port
from pdserve.common.tracing import OUTGOING_TRACE, Tracer
from pdserve.router.timings import STAGES, ChoiceTimings
from tests.router_stack import RouterProcess, send
from tests.test_servers import Server
from tests.test_trust import metric

# The stages that run one after another before the first token reaches the router.
BEFORE_FIRST_TOKEN = ("router_queue_s", "prefill_queue_s", "prefill_s", "destination_wait_s", "transfer_s")
SLACK_S = 0.002  # the breakdown's rounding, and two processes' clocks read a moment apart


@pytest.fixture(scope="module")
def stack(tiny_models):
    """A decode server, a prefill server and a router, every one of them tracing to `receiver`."""
    model = tiny_models("llama")
    port = free_port()
    receiver, otlp = start_receiver(port)
    tracing = ("--otlp-traces-endpoint", f"http://127.0.0.1:{port}")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "50"  # (ms: spans are exported soon after they end; read at start)
    decode, prefill = Server("decode", model, *tracing), Server("prefill", model, *tracing)
    router = None
    try:
        decode.wait_ready()
        prefill.wait_ready()
        router = RouterProcess(model, [prefill], [decode], "--log-level", "info", *tracing)
        router.wait_ready()
        yield model, prefill, decode, router, receiver
    finally:
        del os.environ["OTEL_BSP_SCHEDULE_DELAY"]
        if router is not None:
            router.stop()
        prefill.stop()
        decode.stop()
        otlp.stop(None)


def check_breakdown(timings: dict, wall_s: float) -> None:
    """Every stage present and non-negative, and adding up: the serial stages fit in the time to the
    first token, which with the decode makes the total, itself within what the client waited."""
    assert list(timings) == list(STAGES), timings
    assert all(seconds >= 0 for seconds in timings.values()), timings
    assert timings["prefill_s"] > 0 and timings["transfer_s"] > 0, timings  # a real prefill and transfer
    assert sum(timings[s] for s in BEFORE_FIRST_TOKEN) <= timings["first_token_s"] + SLACK_S, timings
    assert abs(timings["first_token_s"] + timings["decode_s"] - timings["total_s"]) <= SLACK_S, timings
    assert 0 < timings["total_s"] <= wall_s, (timings, wall_s)


def test_answers_carry_the_stage_breakdown_only_when_asked(stack):
    router = stack[3]
    body = {"prompt": [1, 5, 9, 13, 17, 21], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    plain = send(router.url, "/v1/completions", body)
    assert plain.status == 200 and "timings" not in plain.json["choices"][0], plain
    for n in (1, 2):
        started = time.monotonic()
        answer = send(router.url, "/v1/completions", body | {"n": n, "return_timings": True})
        wall = time.monotonic() - started
        assert answer.status == 200, answer
        for choice in answer.json["choices"]:
            check_breakdown(choice["timings"], wall)
    # Streamed: the finish chunk carries it (chat).
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "ignore_eos": True, "stream": True}
    started = time.monotonic()
    streamed = send(router.url, "/v1/chat/completions", chat | {"return_timings": True})
    wall = time.monotonic() - started
    finishes = [e["choices"][0] for e in streamed.events if e != "[DONE]" and e["choices"][0]["finish_reason"]]
    assert len(finishes) == 1, streamed
    check_breakdown(finishes[0]["timings"], wall)
    assert not any("timings" in e["choices"][0] for e in send(router.url, "/v1/chat/completions", chat).events[:-1])
    # /generate: at the top of the answer.
    started = time.monotonic()
    native = {"input_ids": [1, 4, 8], "sampling_params": {"max_tokens": 5, "ignore_eos": True}, "return_timings": True}
    generated = send(router.url, "/generate", native)
    check_breakdown(generated.json["timings"], time.monotonic() - started)
    refused = send(router.url, "/v1/completions", body | {"return_timings": "yes"})
    assert refused.status == 400 and "return_timings" in refused.json["error"]["message"], refused


def test_the_request_log_line_carries_the_breakdown(stack):
    router = stack[3]
    body = {"prompt": [1, 6, 7], "max_tokens": 4, "ignore_eos": True}
    assert send(router.url, "/v1/completions", body).status == 200
    deadline = time.monotonic() + 10
    pattern = r"request \w+: completion, 3 prompt tokens x 1 choices -> 200; 4 completion tokens.*; stages ms: (.*)"
    while not (found := re.findall(pattern, router.output())) and time.monotonic() < deadline:
        time.sleep(0.1)  # (the router's log is a file: its lines arrive a moment later)
    assert found, router.output()[-2000:]
    stages = dict(part.split(" ") for part in found[-1].split(", "))
    assert list(stages) == [s.removesuffix("_s") for s in STAGES], found[-1]
    assert all(float(v) >= 0 for v in stages.values()) and float(stages["total"]) > 0, found[-1]


def test_each_server_histograms_the_stages_it_ran(stack):
    _, prefill, decode, router, _ = stack
    body = {"prompt": [1, 30, 31, 32], "max_tokens": 5, "ignore_eos": True}
    before_p, before_d = prefill.metrics(), decode.metrics()
    for _ in range(3):
        assert send(router.url, "/v1/completions", body).status == 200
    time.sleep(0.2)  # (the last Finished reaches the decode frontend as its answer is sent)
    after_p, after_d = prefill.metrics(), decode.metrics()

    def grew(before: str, after: str, name: str, role: str) -> float:
        count = metric(after, name + "_count", role=role) - metric(before, name + "_count", role=role)
        assert metric(after, name + "_sum", role=role) >= 0
        return count

    for name in ("request_queue", "prefill_compute", "kv_destination_wait", "kv_transfer"):
        assert grew(before_p, after_p, f"pdserve_{name}_seconds", "prefill") == 3, name
    for name in ("request_queue", "kv_wait", "decode_slot_wait", "decode_first_token", "decode"):
        assert grew(before_d, after_d, f"pdserve_{name}_seconds", "decode") == 3, name
    # A decode server prefills nothing here: its local-prefill histogram stays empty.
    assert grew(before_d, after_d, "pdserve_prefill_compute_seconds", "decode") == 0
    assert metric(after_d, "pdserve_decode_seconds_sum", role="decode") > 0


def test_one_trace_across_router_prefill_and_decode_continues_the_clients(stack):
    router, receiver = stack[3], stack[4]
    trace_id, client_span = os.urandom(16).hex(), os.urandom(8).hex()
    body = {"prompt": [1, 40, 41, 42, 43], "max_tokens": 6, "ignore_eos": True}
    request = urllib.request.Request(
        router.url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "traceparent": f"00-{trace_id}-{client_span}-01"},
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert answer.status == 200
    ours = {"pdserve-router", "pdserve-prefill", "pdserve-decode"}
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        spans = [(service, s) for service, s in receiver.spans if s.trace_id.hex() == trace_id]
        if {service for service, _ in spans} == ours and len(spans) >= 13:
            break
        time.sleep(0.1)
    named = {(service, s.name): s for service, s in spans}
    # Each span's parent: the client's span, the router's, each server's, or a stage's.
    parents = {
        ("pdserve-router", "pdserve.request"): None,
        ("pdserve-router", "router_queue"): ("pdserve-router", "pdserve.request"),
        ("pdserve-prefill", "pdserve.prefill"): ("pdserve-router", "pdserve.request"),
        ("pdserve-decode", "pdserve.decode"): ("pdserve-router", "pdserve.request"),
        ("pdserve-decode", "first_decoded_token"): ("pdserve-decode", "decode_steps"),
    }
    for name in ("queue", "prefill", "kv_destination_wait", "kv_transfer"):
        parents["pdserve-prefill", name] = ("pdserve-prefill", "pdserve.prefill")
    for name in ("queue", "kv_wait", "slot_wait", "decode_steps"):
        parents["pdserve-decode", name] = ("pdserve-decode", "pdserve.decode")
    assert sorted(named) == sorted(parents) and len(spans) == len(parents), sorted(named)
    root = named["pdserve-router", "pdserve.request"]
    assert root.parent_span_id.hex() == client_span  # the client's trace, continued
    for key, parent_key in parents.items():
        if parent_key is None:
            continue
        span, parent = named[key], named[parent_key]
        assert span.parent_span_id == parent.span_id, key
        # (clocks of one host: a child within its parent, give or take a millisecond)
        assert parent.start_time_unix_nano - 1e6 <= span.start_time_unix_nano <= span.end_time_unix_nano, key
        if key != ("pdserve-decode", "pdserve.decode"):  # (it may outlast the router's: see below)
            assert span.end_time_unix_nano <= parent.end_time_unix_nano + 1e6, key
    # The router ends a choice on its last token; the decode server's span ends when that request's
    # Finished message reaches its frontend, a moment later (2.5 ms seen on a loaded 2-core box).
    decode_end = named["pdserve-decode", "pdserve.decode"].end_time_unix_nano
    assert decode_end <= named["pdserve-router", "pdserve.request"].end_time_unix_nano + 5e8
    transfer = {a.key: a.value for a in named["pdserve-prefill", "kv_transfer"].attributes}
    assert transfer["pdserve.kv_transfer.pages"].int_value >= 1, transfer
    assert transfer["pdserve.kv_transfer.bytes"].int_value > 0, transfer
    assert transfer["pdserve.kv_transfer.path"].string_value == "nixl", transfer  # (DRAM pools: NIXL)
    steps = {a.key: a.value.int_value for a in named["pdserve-decode", "decode_steps"].attributes}
    assert steps == {"pdserve.decode.steps": 5}, steps  # tokens 2..6, one a step (no speculation)
    prefill = {a.key: a.value.int_value for a in named["pdserve-prefill", "prefill"].attributes}
    assert prefill == {"pdserve.prefill.chunks": 1}
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["gen_ai.usage.output_tokens"].int_value == 6
    assert attributes["gen_ai.usage.input_tokens"].int_value == 5


def test_tracing_off_imports_no_opentelemetry():
    """Off (no flag, no OTEL endpoint in the environment), a router or server frontend imports nothing of
    the SDK or its exporter (FastAPI imports OpenTelemetry's API itself)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    code = (
        "import sys; import pdserve.router.app, pdserve.common.serving.frontend; "
        "from pdserve.common.tracing import start_tracing; assert start_tracing('x', '') is None; "
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_choices_span_continues_the_client_and_records_retries_migrations_and_failures():
    """In-process, with the SDK's in-memory exporter: the span a choice runs in (router/timings.py)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    exporter = InMemorySpanExporter()
    tracer = Tracer("pdserve-router", "", exporter)
    client = {"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01"}
    clock = ChoiceTimings(time.monotonic() - 0.01, tracer, client)
    with clock.traced("tiny", 3):
        sent = OUTGOING_TRACE.get()  # what the choice's requests carry to the servers
        clock.event("prefill_retry", {"pdserve.failed_prefill_server": "p:1"})
        clock.event("migration", {"pdserve.from": "d:1", "pdserve.to": "d:2", "pdserve.tokens_sent": 4})
    assert OUTGOING_TRACE.get() is None
    failing = ChoiceTimings(time.monotonic(), tracer)
    with pytest.raises(RuntimeError), failing.traced("tiny", 3):
        raise RuntimeError("no healthy decode server")
    ChoiceTimings(time.monotonic()).event("migration", {})  # not traced: nothing to record, nothing fails
    first, second = [s for s in exporter.get_finished_spans() if s.name == "pdserve.request"]
    assert first.context.trace_id == int("ab" * 16, 16) and first.parent.span_id == int("cd" * 8, 16)
    assert sent["traceparent"] == f"00-{'ab' * 16}-{first.context.span_id:016x}-01"
    assert [e.name for e in first.events] == ["prefill_retry", "migration"]
    assert first.events[1].attributes["pdserve.to"] == "d:2"
    assert second.parent is None and second.status.status_code is StatusCode.ERROR
    assert "no healthy decode server" in second.status.description


DASHBOARD = pathlib.Path(__file__).parent.parent / "deploy" / "k8s" / "base" / "grafana-dashboard.json"


def dashboard_metrics() -> set[str]:
    """Every pdserve metric family a panel of the Grafana dashboard queries (suffixes stripped)."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [target["expr"] for panel in panels for target in panel.get("targets", ())]
    names = set(re.findall(r"\bpdserve_[a-z0-9_]+", " ".join(exprs)))
    return {re.sub(r"_(bucket|count|sum|total)$", "", name) for name in names}


def test_every_metric_the_dashboard_queries_is_served(stack):
    """After a request, each family the dashboard reads is on the router's or a server's /metrics
    (declared: labelled ones have no series until they happen); its SLO choices are histogram bounds."""
    model, prefill, decode, router, _ = stack
    openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0).completions.create(
        model=model, prompt="a few tokens", max_tokens=4, temperature=0
    )
    served = router.metrics() + prefill.metrics() + decode.metrics()
    families = {re.sub(r"_total$", "", f) for f in re.findall(r"^# TYPE (pdserve_[a-z0-9_]+) ", served, re.M)}
    wanted = dashboard_metrics()
    assert len(wanted) >= 25 and wanted - families == set(), sorted(wanted - families)
    variables = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    for name, histogram in (("ttft_slo", "time_to_first_token"), ("tpot_slo", "time_per_output_token")):
        bounds = set(re.findall(rf'pdserve_router_{histogram}_seconds_bucket{{le="([^"]+)"}}', served))
        assert {o["value"] for o in variables[name]["options"]} <= bounds, (name, bounds)


def test_a_chunked_prefill_reports_each_batchs_time_and_its_trace_gets_a_span_per_chunk(tiny_models):
    """A prompt computed in several prefill batches: the prefill server's answer carries each batch's
    share of its prefill time (prefill/scheduler.py chunk_durations), and its trace a `prefill_chunk`
    span per batch under the prefill stage, one after another, the last ending with the stage."""
    import dataclasses

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pdserve.common.config import EngineConfig
    from pdserve.common.serving import ipc
    from pdserve.common.serving.request_spans import Arrival, record_prefill
    from pdserve.common.types import SamplingParams
    from pdserve.decode.engine import DecodeEngine
    from pdserve.prefill.engine import PrefillEngine
    from tests.test_disagg_engines import drive

    path = tiny_models("llama")
    config = EngineConfig(model_path=path, device="cpu", max_total_tokens=2048, page_size=4)
    prefill = PrefillEngine(dataclasses.replace(config, chunked_prefill_size=16), "prefill-chunks")
    decode = DecodeEngine(config, "decode-chunks")
    try:
        prompt = [1] + list(range(5, 60))  # 56 tokens: four batches of at most 16
        _, results = drive(prefill, decode, [prompt], [SamplingParams(max_new_tokens=2, temperature=0)])
    finally:
        prefill.close()
        decode.close()
    result = results["r0"]
    assert result.prefill_chunks == 4 and len(result.chunk_s) == 4, result
    assert all(s >= 0 for s in result.chunk_s) and abs(sum(result.chunk_s) - result.prefill_s) < 1e-3, result

    exporter = InMemorySpanExporter()
    tracer = Tracer("pdserve-prefill", "", exporter)
    done = ipc.PrefillDone(
        "r0", 7, None, 56, 0, queue_s=0.001, prefill_s=0.04, transfer_s=0.002, transfer_bytes=4096,
        prefill_chunks=4, chunk_s=(0.01, 0.012, 0.008, 0.01),
    )  # fmt: skip
    record_prefill(tracer, Arrival(None, time.time_ns() - 60_000_000), done)
    spans = {s.name: s for s in exporter.get_finished_spans() if s.name != "prefill_chunk"}
    chunks = sorted((s for s in exporter.get_finished_spans() if s.name == "prefill_chunk"), key=lambda s: s.start_time)
    stage = spans["prefill"]
    assert [dict(s.attributes)["pdserve.prefill.chunk"] for s in chunks] == [0, 1, 2, 3]
    assert all(s.parent.span_id == stage.context.span_id for s in chunks)
    assert chunks[0].start_time == stage.start_time and chunks[-1].end_time == stage.end_time
    assert all(a.end_time == b.start_time for a, b in zip(chunks, chunks[1:]))
    assert abs((chunks[1].end_time - chunks[1].start_time) - 12_000_000) < 1000


def test_a_speculative_decodes_span_carries_its_steps_and_drafts():
    """The decode_steps span of a request decoded with speculation: its steps, drafts verified and
    accepted (DecodeTimings' counts, from the Req: tests/test_speculative_engine.py checks those)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pdserve.common.serving import ipc
    from pdserve.common.serving.request_spans import Arrival, record_decode

    exporter = InMemorySpanExporter()
    tracer = Tracer("pdserve-decode", "", exporter)
    timings = ipc.DecodeTimings(decode_s=0.02, first_token_s=0.004, steps=6, spec_proposed=18, spec_accepted=12)
    finished = ipc.Finished("r0", "length", 8, 24, timings=timings)
    record_decode(tracer, Arrival(None, time.time_ns() - 30_000_000), finished)
    (decode,) = [s for s in exporter.get_finished_spans() if s.name == "decode_steps"]
    assert dict(decode.attributes) == {
        "pdserve.decode.steps": 6,
        "pdserve.speculative.proposed_tokens": 18,
        "pdserve.speculative.accepted_tokens": 12,
    }
