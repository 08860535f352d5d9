"""--disagg-policy through real servers and the router (issue 22's first step): with `auto`, short
prompts are prefilled by the decode server itself and long ones by the prefill server, in one run;
with `never`, decode servers alone serve (no prefill server at all). Greedy outputs equal
transformers' either way; every decision is counted on /metrics."""

import re
import time

import openai
import pytest

from pdserve.common.ports import free_port
from tests.router_stack import RouterProcess
from tests.test_disagg_engines import hf_greedy
from tests.test_servers import Server

LOCAL_MAX = 24


@pytest.fixture(scope="module")
def servers(tiny_models):
    model = tiny_models("llama")
    prefill, decode = Server("prefill", model), Server("decode", model, "--chunked-prefill-size", "16")
    routers = []
    try:
        prefill.wait_ready()
        decode.wait_ready()

        def router(prefills, *flags, ready=True):
            r = RouterProcess(model, prefills, [decode], *flags)
            routers.append(r)
            if ready:
                r.wait_ready()
            return r, openai.OpenAI(base_url=f"{r.url}/v1", api_key="unused", timeout=120, max_retries=0)

        yield model, prefill, router
    finally:
        for r in routers:
            r.stop()
        prefill.stop()
        decode.stop()


def decisions(router) -> dict[tuple[str, str], float]:
    found = re.findall(
        r'pdserve_router_prefill_decisions_total\{reason="(\w+)",where="(\w+)"\} (\S+)', router.metrics()
    )
    return {(where, reason): float(n) for reason, where, n in found}


def prompts_of(lengths: list[int], first: int = 0) -> list[list[int]]:
    """Prompts sharing no first token (so no prefix), of these lengths."""
    return [[5 + first + i] + [5 + (7 * i + 3 * j) % 500 for j in range(n - 1)] for i, n in enumerate(lengths)]


def test_auto_prefills_short_prompts_locally_and_long_ones_remotely(servers):
    model, prefill, router = servers
    r, client = router([prefill], "--disagg-policy", "auto", "--local-prefill-max-tokens", str(LOCAL_MAX))
    prompts = prompts_of([5, 60, 12, 90, 24, 25])
    expected = hf_greedy(model, prompts, 8)
    out = client.completions.create(
        model=model,
        prompt=prompts,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True, "return_timings": True},
    )
    assert [c.model_extra["token_ids"] for c in sorted(out.choices, key=lambda c: c.index)] == expected
    assert decisions(r) == {("local", "short_prompt"): 3.0, ("remote", "long_prompt"): 3.0}
    # Their timings say where each was prefilled: a local prefill's queue and prefill are the decode
    # server's, and nothing was transferred (router/timings.py).
    for choice in out.choices:
        timings, local = choice.model_extra["timings"], len(prompts[choice.index]) <= LOCAL_MAX
        assert timings["prefill_s"] > 0 and timings["total_s"] >= timings["first_token_s"] > 0, timings
        assert (timings["transfer_s"] == 0) == local and (timings["destination_wait_s"] == 0 or not local), timings
    # Streamed from a local prefill: the same tokens, the first one included.
    kwargs = dict(model=model, prompt=prompts[0], max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    assert "".join(c.text for chunk in client.completions.create(stream=True, **kwargs) for c in chunk.choices) == whole
    # Prompt logprobs are a prefill server's work, whatever the prompt's length.
    client.completions.create(model=model, prompt=prompts[0], max_tokens=2, extra_body={"prompt_logprobs": 1})
    assert decisions(r) == {
        ("local", "short_prompt"): 3.0,
        ("remote", "long_prompt"): 3.0,
        ("local", "cached_prefix"): 2.0,
        ("remote", "prompt_logprobs"): 1.0,
    }


def test_auto_keeps_a_conversations_next_turn_on_its_decode_server(servers):
    """The next turn's prompt is the last one plus a few tokens: the decode server holds the rest in
    its prefix cache (the router remembers what it sent there), so it prefills the turn itself."""
    model, prefill, router = servers
    r, client = router([prefill], "--disagg-policy", "auto", "--local-prefill-max-tokens", str(LOCAL_MAX))
    turn1 = prompts_of([80], first=300)[0]
    turn2 = turn1 + [17, 18, 19, 20, 21, 22]
    expected = hf_greedy(model, [turn1, turn2], 6)
    outs = [
        client.completions.create(
            model=model,
            prompt=ids,
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        for ids in (turn1, turn2)
    ]
    assert [o.choices[0].model_extra["token_ids"] for o in outs] == expected
    assert decisions(r) == {("remote", "long_prompt"): 1.0, ("local", "cached_prefix"): 1.0}
    assert outs[1].usage.prompt_tokens_details.cached_tokens >= len(turn1) - 16  # (whole pages of it)


def test_never_serves_with_decode_servers_alone(servers):
    model, _, router = servers
    r, client = router([], "--disagg-policy", "never")
    prompts = prompts_of([7, 70])
    expected = hf_greedy(model, prompts, 6)
    for ids, want in zip(prompts, expected):
        out = client.completions.create(
            model=model,
            prompt=ids,
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert out.choices[0].model_extra["token_ids"] == want
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert decisions(r) == {("local", "never"): 3.0}


class _Nowhere:
    """A prefill server that never answers: nothing listens on its port."""

    address = f"127.0.0.1:{free_port()}"


def test_with_no_healthy_prefill_server_requests_fail_or_go_local_as_configured(servers):
    """--prefill-fallback: with every prefill server down, `fail` (the default) answers 503 saying so,
    `local` has the decode server prefill (greedy output unchanged); each counted and logged."""
    model, _, router = servers
    r, client = router([_Nowhere], "--prefill-fallback", "local")
    prompts = prompts_of([7, 40])
    expected = hf_greedy(model, prompts, 6)
    for ids, want in zip(prompts, expected):
        out = client.completions.create(
            model=model, prompt=ids, max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        assert out.choices[0].model_extra["token_ids"] == want
    assert decisions(r) == {("local", "no_prefill_server"): 2.0}
    assert r.output().count("no healthy prefill server: decode servers prefill requests themselves") == 1

    failing, client = router([_Nowhere], ready=False)  # (never ready: no prefill server, no fallback)
    deadline = time.monotonic() + 30
    refused = None
    while refused is None or "no healthy prefill server (--prefill-fallback local" not in str(refused):
        # (until it listens, and its decode server has passed a check; no prefill server ever does)
        assert time.monotonic() < deadline, str(refused)
        time.sleep(0.2)
        try:
            client.completions.create(model=model, prompt="hello", max_tokens=2)
            pytest.fail("served without a prefill server")
        except openai.APIConnectionError as e:
            refused = e
        except openai.APIStatusError as e:
            refused = e
    assert refused.status_code == 503
    assert decisions(failing)[("failed", "no_prefill_server")] >= 1
    assert "no healthy prefill server: requests fail (--prefill-fallback fail)" in failing.output()


def test_the_prefill_fallback_decides_only_when_no_prefill_server_is_healthy():
    from pdserve.router.disagg import Disaggregation
    from pdserve.router.policies import WorkerView

    up, down = [WorkerView("p:1", True, load=0, inflight=0)], [WorkerView("p:1", False, load=0, inflight=0)]
    local = Disaggregation("always", local_max_tokens=4, queue_threshold=3, fallback="local")
    assert local.decide("d:1", [1, 2], False, lambda: up) == ("remote", "always")
    assert local.decide("d:1", [1, 2], False, lambda: down) == ("local", "no_prefill_server")
    fail = Disaggregation("always", local_max_tokens=4, queue_threshold=3)
    assert fail.decide("d:1", [1, 2], False, lambda: pytest.fail("asked for the prefill servers")) == (
        "remote",
        "always",
    )


def test_a_router_without_prefill_servers_needs_never(tiny_models):
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.router.cli",
            "--model-path",
            tiny_models("llama"),
            "--decode",
            "127.0.0.1:1",
            "--workers",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "--disagg-policy never" in proc.stderr + proc.stdout


def test_pdserve_up_with_decode_servers_alone(tiny_models):
    import os
    import signal
    import subprocess
    import sys

    from tests.router_stack import pdserve_up

    model = tiny_models("llama")
    # No prefill server and a policy that needs one is refused; --num-prefill 0 alone means never.
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.common.cli",
            "up",
            "--model-path",
            model,
            "--device",
            "cpu",
            "--num-prefill",
            "0",
            "--disagg-policy",
            "always",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "--num-prefill 0 needs --disagg-policy never" in refused.stderr
    # Started as `pdserve up &` in a script (SIGINT ignored), in a process group of its own as a
    # terminal starts it; a Ctrl-C there reaches every process of the group at once (the schedulers
    # and the grammar worker too): all stop in order, with no traceback, no error and no leaked
    # shared memory (a grammar request first, so that the grammar worker's shared buffers exist).
    proc, port, _ = pdserve_up(
        model, "--num-prefill", "0", "--router-workers", "1", sigint_ignored=True, own_group=True
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0)
        ids = prompts_of([9])[0]
        out = client.completions.create(
            model=model,
            prompt=ids,
            max_tokens=5,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert out.choices[0].model_extra["token_ids"] == hf_greedy(model, [ids], 5)[0]
        structured = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            response_format={"type": "json_object"},
        )
        assert structured.choices[0].finish_reason in ("stop", "length")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        rest = proc.communicate(timeout=90)[0]
    assert proc.returncode == 0, rest
    for trouble in ("Traceback", "ERROR", "leaked", "exited (code"):
        assert trouble not in rest, rest


def test_auto_goes_local_when_no_prefill_server_can_take_the_prompt_soon():
    from pdserve.router.disagg import Disaggregation
    from pdserve.router.policies import WorkerView

    auto = Disaggregation("auto", local_max_tokens=4, queue_threshold=3)
    busy = [WorkerView("p:1", True, load=2, inflight=1), WorkerView("p:2", True, load=5, inflight=0)]
    free = [WorkerView("p:1", True, load=1, inflight=0), WorkerView("p:2", False, load=0, inflight=0)]
    long = list(range(10, 40))
    assert auto.decide("d:1", long, False, lambda: free) == ("remote", "long_prompt")
    assert auto.decide("d:2", long[::-1], False, lambda: busy) == ("local", "prefill_saturated")
    assert auto.decide("d:3", long, False, lambda: [free[1]]) == ("local", "no_prefill_server")
    assert auto.decide("d:1", long + [1, 2], False, lambda: free) == ("local", "cached_prefix")  # d:1 holds `long`
    assert auto.decide("d:1", long + [1, 2], True, lambda: free) == ("remote", "prompt_logprobs")
    assert auto.decide("d:9", [1, 2, 3], False, lambda: free) == ("local", "short_prompt")


def test_prefix_policies_route_decode_servers_under_any_disagg_policy():
    from pdserve.router.config import RouterConfig

    config = RouterConfig(
        model_path="/m", decode=("d:1", "d:2"), decode_policy="cache_aware", disagg_policy="never", workers=1
    )
    config.check()
    assert config.resolve().decode_policy == "cache_aware"
    assert (
        RouterConfig(model_path="/m", decode=("d:1",), decode_policy="cache_aware", disagg_policy="never", workers=2)
        .resolve()
        .decode_policy
        == "prefix_hash"
    )  # one tree per process would scatter it
    # --disagg-policy always too: a decode server holding a prompt's prefix is sent only the rest
    RouterConfig(model_path="/m", prefill=("p:1",), decode=("d:1",), decode_policy="cache_aware").check()
