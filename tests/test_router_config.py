"""`pdserve-router`'s flags come from RouterConfig's fields, and every timeout is one of them.

The prefill attempt's timeout used to be a module constant (120 s) that silently capped a longer
--request-timeout; now it follows the request's deadline unless --prefill-timeout says otherwise.
"""

from __future__ import annotations

import asyncio
import dataclasses
import resource

import grpc
import pytest

from pdserve.common.config import from_cli_args
from pdserve.common.types import SamplingParams
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.router.cli import build_parser, main
from pdserve.router.config import RouterConfig
from pdserve.router.pairing import paired_generate
from tests.test_pairing import TIMEOUT_S, FakeDecode, StreamedPrefill

FLAGS = [
    "--model-path",
    "--prefill",
    "--decode",
    "--prefill-dns",
    "--decode-dns",
    "--served-model-name",
    "--context-length",
    "--generation-config",
    "--override-generation-config",
    "--default-max-tokens",
    "--api-key",
    "--prefill-policy",
    "--decode-policy",
    "--decode-stream",
    "--max-inflight",
    "--max-queued",
    "--queue-timeout",
    "--max-choices",
    "--max-choices-at-once",
    "--max-body-bytes",
    "--request-timeout",
    "--stream-send-timeout",
    "--header-timeout",
    "--body-timeout",
    "--max-connections-per-worker",
    "--prefill-timeout",
    "--decode-timeout",
    "--max-prefill-attempts",
    "--max-migrations",
    "--disagg-policy",
    "--prefill-fallback",
    "--local-prefill-max-tokens",
    "--prefill-queue-threshold",
    "--health-check-interval",
    "--health-check-timeout",
    "--dns-interval",
    "--circuit-failures",
    "--circuit-open-time",
    "--host",
    "--port",
    "--workers",
    "--no-warm-spare",
    "--drain-timeout",
    "--log-level",
    "--otlp-traces-endpoint",
    "--cluster-secret-file",
    "--tls-cert",
    "--tls-key",
    "--tls-ca",
    "--allow-unauthenticated",
]
SERVERS = ["--prefill", "p:1", "p:2", "--decode", "d:1"]


def test_the_parser_has_a_flag_per_field_with_its_default():
    actions = {a.option_strings[0]: a for a in build_parser()._actions if a.option_strings[0] != "-h"}
    assert list(actions) == FLAGS
    for f in dataclasses.fields(RouterConfig):
        action = actions["--" + f.name.replace("_", "-")]
        assert action.dest == f.name and action.default == f.default and action.help == f.metadata["help"]
    assert [flag for flag, a in actions.items() if a.nargs == "+"] == [
        "--prefill",
        "--decode",
        "--prefill-dns",
        "--decode-dns",
    ]
    assert [flag for flag, a in actions.items() if a.required] == ["--model-path"]
    defaults = RouterConfig()
    assert (defaults.prefill_policy, defaults.decode_policy, defaults.max_inflight, defaults.request_timeout) == (
        "round_robin",
        "round_robin",
        1024,
        600.0,
    )
    assert (defaults.host, defaults.port, defaults.log_level) == ("127.0.0.1", 8000, "info")


def test_a_command_line_gives_a_frozen_config():
    argv = [
        "--model-path",
        "/m",
        *SERVERS,
        "--decode-dns",
        "dec.svc:50051",
        "--prefill-policy",
        "cache_aware",
        "--max-inflight",
        "8",
        "--request-timeout",
        "30",
        "--max-prefill-attempts",
        "2",
        "--port",
        "9000",
    ]
    config = from_cli_args(build_parser().parse_args(argv), RouterConfig)
    assert config == RouterConfig(
        "/m",
        ("p:1", "p:2"),
        ("d:1",),
        decode_dns=("dec.svc:50051",),
        prefill_policy="cache_aware",
        max_inflight=8,
        request_timeout=30.0,
        max_prefill_attempts=2,
        port=9000,
    )
    config.check()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max-inflight", "0"], "--max-inflight must be >= 1"),
        (["--request-timeout", "0"], "--request-timeout must be > 0"),
        (["--prefill-timeout", "-1"], "--prefill-timeout must be >= 0"),
        (["--health-check-interval", "0"], "--health-check-interval must be > 0"),
        (["--max-prefill-attempts", "0"], "--max-prefill-attempts must be >= 1"),
        (["--max-migrations", "-1"], "--max-migrations must be >= 0"),
        (["--decode-policy", "closest"], "--decode-policy: unknown policy 'closest'"),
        (["--prefill-policy", "fastest"], "--prefill-policy: unknown policy 'fastest'"),
        (["--prefill-dns", "no-port"], "expected NAME:PORT, got 'no-port'"),
        (["--log-level", "loud"], "--log-level must be"),
        (["--max-queued", "-1"], "--max-queued must be >= 0"),
        (["--queue-timeout", "0"], "--queue-timeout must be > 0"),
        (["--max-choices", "0"], "--max-choices must be >= 1"),
        (["--max-choices-at-once", "0"], "--max-choices-at-once must be >= 1"),
        (["--disagg-policy", "sometimes"], "--disagg-policy must be always, never or auto"),
        (["--prefill-queue-threshold", "0"], "--prefill-queue-threshold >= 1"),
        (["--header-timeout", "0"], "--header-timeout must be > 0"),
        (["--body-timeout", "-1"], "--body-timeout must be > 0"),
        (["--drain-timeout", "0"], "--drain-timeout must be > 0"),
        (["--max-connections-per-worker", "-1"], "--max-connections-per-worker must be >= 0"),
    ],
)
def test_a_bad_value_exits_2_with_a_message(capsys, extra, message):
    assert main(["--model-path", "/m", *SERVERS, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_no_prefill_or_no_decode_source_exits_2(capsys):
    assert main(["--model-path", "/m", "--prefill", "p:1"]) == 2
    assert "decode servers (--decode or --decode-dns)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse's own: --model-path is required
        main(SERVERS)
    assert e.value.code == 2


class TimedPrefill(StreamedPrefill):
    """Records how long the router gave the prefill call (its gRPC deadline)."""

    async def PrefillStreamed(self, request_iterator, context):
        self.time_remaining = context.time_remaining()
        return await super().PrefillStreamed(request_iterator, context)


def prefill_time_given(*argv: str) -> float:
    """Seconds the first prefill attempt of one paired request may take, under these flags."""
    config = from_cli_args(build_parser().parse_args(["--model-path", "/m", *SERVERS, *argv]), RouterConfig)
    prefill = TimedPrefill()

    async def run() -> None:
        server = grpc.aio.server()
        pb_grpc.add_DecodeServiceServicer_to_server(FakeDecode(release=prefill.got_request), server)
        pb_grpc.add_PrefillServiceServicer_to_server(prefill, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stream = paired_generate(
                    channel,
                    lambda tried: None if tried else ("prefill-0", channel),
                    lambda url, ok: None,
                    [1, 2, 3],
                    SamplingParams(max_new_tokens=3, seed=5),
                    config,
                )
                assert [e.kind async for e in stream] == ["tokens", "tokens", "finish"]
        finally:
            await server.stop(None)

    asyncio.run(asyncio.wait_for(run(), 3 * TIMEOUT_S))
    return prefill.time_remaining


def test_the_prefill_timeout_follows_the_request_timeout():
    assert RouterConfig().prefill_timeout == 0  # 0: the request's deadline
    # NOTE: gRPC sends the timeout rounded (up) to a coarser unit: the server may see a bit more.
    assert prefill_time_given("--request-timeout", "600") == pytest.approx(600, abs=5)  # not capped at 120 s
    assert prefill_time_given("--request-timeout", "600", "--prefill-timeout", "30") == pytest.approx(30, abs=5)
    assert prefill_time_given("--request-timeout", "10", "--prefill-timeout", "30") == pytest.approx(
        10, abs=3
    )  # the deadline


def test_the_connection_guards_take_their_flags_and_size_the_cap_from_the_open_file_limit(monkeypatch):
    from pdserve.router import http_protocol
    from pdserve.router.http_protocol import DEFAULT_MAX_CONNECTIONS, FD_RESERVE, Guards

    def guards(*argv: str) -> Guards:
        config = from_cli_args(build_parser().parse_args(["--model-path", "/m", *SERVERS, *argv]), RouterConfig)
        config.check()
        return Guards.from_config(config, count=lambda reason: None)

    defaults = RouterConfig()
    assert (defaults.header_timeout, defaults.body_timeout, defaults.max_connections_per_worker) == (20.0, 60.0, 0)
    given = guards("--header-timeout", "5", "--body-timeout", "7", "--max-connections-per-worker", "100")
    assert (given.header_timeout_s, given.body_timeout_s, given.max_connections) == (5.0, 7.0, 100)
    for soft, cap in [(1024, 1024 - FD_RESERVE), (1 << 20, DEFAULT_MAX_CONNECTIONS), (200, 64)]:
        monkeypatch.setattr(http_protocol.resource, "getrlimit", lambda _, soft=soft: (soft, resource.RLIM_INFINITY))
        assert guards().max_connections == cap


@pytest.mark.parametrize(
    "soft, hard, refused, asked, left",
    [
        (1024, 65536, False, [(65536, 65536)], 65536),  # raised to the hard limit
        (1024, resource.RLIM_INFINITY, False, [(1 << 20, resource.RLIM_INFINITY)], 1 << 20),  # to Linux's nr_open
        (65536, 65536, False, [], 65536),  # already there: nothing asked
        (1024, 65536, True, [(65536, 65536)], 1024),  # the kernel says no: left as it was, one warning
    ],
)
def test_a_router_process_raises_its_open_file_limit_to_the_hard_one(
    monkeypatch, caplog, soft, hard, refused, asked, left
):
    from pdserve.router import http_protocol

    calls = []

    def setrlimit(which, limits):
        calls.append(limits)
        if refused:
            raise ValueError("not allowed to raise maximum limit")

    monkeypatch.setattr(http_protocol.resource, "getrlimit", lambda which: (soft, hard))
    monkeypatch.setattr(http_protocol.resource, "setrlimit", setrlimit)
    assert http_protocol.raise_open_file_limit() == left and calls == asked
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == (["the open-file limit stays at 1024 (raising it to 65536 failed: not allowed to raise "
                         "maximum limit); see --max-connections-per-worker"] if refused else [])  # fmt: skip


def test_a_router_process_drains_for_at_most_the_drain_timeout_and_logs_http_access_only_at_debug(
    tiny_models, monkeypatch
):
    """uvicorn's graceful shutdown is bounded by --drain-timeout (uvicorn's default waits forever); its
    access log is on only at debug (at info the router logs its own line per OpenAI request)."""
    from pdserve.router import serve

    monkeypatch.setattr(serve, "tune_gc", lambda: None)  # (a process-wide setting: not in the test process)
    model = tiny_models("llama")
    config = RouterConfig(model_path=model, decode=("127.0.0.1:1",))
    server = serve.build(config, None)
    assert (server.config.timeout_graceful_shutdown, server.config.access_log) == (120.0, False)
    server = serve.build(dataclasses.replace(config, drain_timeout=5.0, log_level="debug"), None)
    assert (server.config.timeout_graceful_shutdown, server.config.access_log) == (5.0, True)


def test_repeated_worker_flags_add_workers_and_a_duplicate_is_refused(capsys):
    """`--decode A --decode B` is two decode servers (argparse alone keeps only B, silently), as is
    `--decode A B`; a server named twice is an error that names it. The bench's list flags add up too."""
    from pdserve.bench.cli import add_bench_parser
    from pdserve.router.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["--model-path", "m", "--decode", "a:1", "--decode", "b:2", "c:3", "--prefill", "p:4"])
    assert (args.decode, args.prefill, args.prefill_dns) == (["a:1", "b:2", "c:3"], ["p:4"], ())
    assert parser.parse_args(["--model-path", "m", "--decode", "a:1", "b:2"]).decode == ["a:1", "b:2"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "m", "--decode", "a:1", "--decode", "a:1"])
    assert "argument --decode: a:1 is given twice" in capsys.readouterr().err

    import argparse

    top = argparse.ArgumentParser()
    add_bench_parser(top.add_subparsers())
    serve = top.parse_args(["bench", "serve", "--max-concurrency", "0", "--max-concurrency", "256"])
    assert serve.max_concurrency == [0, 256]
    assert top.parse_args(["bench", "serve"]).max_concurrency == [0]  # the default, untouched
