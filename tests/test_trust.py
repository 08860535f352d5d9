"""Trust boundaries (issue 20): only the router reaches a server, only a granted transfer counts.

Real processes and sockets: a decode server, a prefill server and a router sharing a cluster
secret. A caller without it gets UNAUTHENTICATED from every RPC but health (GetAgentMetadata
included), so a forged Prefill writes nothing; a KV notification that matches no destination the
decode server granted is refused, counted and changes no request. Then the settings themselves
(a public address needs a secret, TLS files go together) and mutual TLS with a throwaway CA.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.common.kv_transfer import encode_notif
from pdserve.common.ports import free_port
from pdserve.common.scheduling.pages import pages_for
from pdserve.common.server_config import TrustConfig
from pdserve.common.trust import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    SECRET_METADATA_KEY,
    ClusterSecretCheck,
    add_port,
    check_exposure,
    is_loopback,
    load_trust,
    open_channel,
    server_interceptors,
    write_secret_file,
)
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from tests.test_disagg_engines import hf_greedy
from tests.test_servers import params

TIMEOUT_S = 60.0


class Proc:
    """A server or router process whose output goes to a file (readable while it runs)."""

    def __init__(self, name: str, argv: list[str], log_dir):
        self.name, self.log = name, log_dir / f"{name}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", *argv], stdout=out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text()

    def check_alive(self) -> None:
        assert self.proc.poll() is None, f"{self.name} exited:\n{self.output()}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def metric(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name + "{"):
            series, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in series for k, v in labels.items()):
                return float(value)
    raise AssertionError(f"no series {name}{{{want}}}")


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    """A decode server, a prefill server and a router (one process) sharing a fresh secret."""
    model = tiny_models("llama")
    tmp = tmp_path_factory.mktemp("trust")
    secret_file = write_secret_file(str(tmp))
    secret = ["--cluster-secret-file", secret_file]
    ports = {name: (free_port(), free_port()) for name in ("decode", "prefill")}
    router_port = free_port()
    procs = {}
    try:
        for role, (port, metrics_port) in ports.items():
            procs[role] = Proc(
                role,
                [
                    f"pdserve.{role}.cli",
                    "--model-path",
                    model,
                    "--device",
                    "cpu",
                    "--port",
                    str(port),
                    "--metrics-port",
                    str(metrics_port),
                    "--max-total-tokens",
                    "4096",
                    "--kv-transfer-timeout",
                    "20",
                    "--log-level",
                    "warning",
                    *secret,
                ],
                tmp,
            )
        procs["router"] = Proc(
            "router",
            [
                "pdserve.router.cli",
                "--model-path",
                model,
                "--prefill",
                f"127.0.0.1:{ports['prefill'][0]}",
                "--decode",
                f"127.0.0.1:{ports['decode'][0]}",
                "--port",
                str(router_port),
                "--workers",
                "1",
                "--health-check-interval",
                "0.2",
                "--log-level",
                "warning",
                *secret,
            ],
            tmp,
        )
        base = f"http://127.0.0.1:{router_port}"
        deadline = time.monotonic() + 120
        while True:
            for p in procs.values():
                p.check_alive()
            try:
                with urllib.request.urlopen(base + "/readiness", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the cluster did not get ready"
            time.sleep(0.2)
        trust = load_trust(TrustConfig(cluster_secret_file=secret_file))
        yield dict(
            model=model,
            base=base,
            trust=trust,
            procs=procs,
            secret_file=secret_file,
            decode=f"127.0.0.1:{ports['decode'][0]}",
            prefill=f"127.0.0.1:{ports['prefill'][0]}",
            decode_metrics=ports["decode"][1],
            prefill_metrics=ports["prefill"][1],
        )
    finally:
        for p in procs.values():
            p.stop()
        for role in ("decode", "prefill"):
            if role in procs:
                assert procs[role].proc.returncode == 0, f"{role} did not exit cleanly:\n{procs[role].output()}"


def call(channel: grpc.Channel, method, metadata=()):
    """Call `method` (a proto MethodDescriptor) with empty request bytes, as a stranger would."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    kind = (method.client_streaming, method.server_streaming)
    if kind == (False, False):
        return channel.unary_unary(path)(b"", metadata=metadata, timeout=10)
    if kind == (False, True):
        return list(channel.unary_stream(path)(b"", metadata=metadata, timeout=10))
    if kind == (True, False):
        return channel.stream_unary(path)(iter([b""]), metadata=metadata, timeout=10)
    return list(channel.stream_stream(path)(iter([b""]), metadata=metadata, timeout=10))


def test_every_rpc_but_health_needs_the_secret(cluster):
    wrong = ((SECRET_METADATA_KEY, secrets.token_hex(32)),)
    for role, service in (("decode", "DecodeService"), ("prefill", "PrefillService")):
        methods = pb.DESCRIPTOR.services_by_name[service].methods
        assert {"GetAgentMetadata", "GetLoad", "Abort"} <= {m.name for m in methods}
        before = metric(metrics(cluster[f"{role}_metrics"]), "pdserve_unauthenticated_rpcs_total", role=role)
        with grpc.insecure_channel(cluster[role]) as channel:
            for method in methods:
                for metadata in ((), wrong):
                    with pytest.raises(grpc.RpcError) as refused:
                        call(channel, method, metadata)
                    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, (role, method.name)
                    assert "cluster secret" in refused.value.details()
            with pytest.raises(grpc.RpcError) as unknown:  # no method probing either
                channel.unary_unary(f"/pdserve.v1.{service}/NoSuchMethod")(b"", timeout=10)
            assert unknown.value.code() == grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        after = metric(metrics(cluster[f"{role}_metrics"]), "pdserve_unauthenticated_rpcs_total", role=role)
        assert after - before == 2 * len(methods) + 1

    async def with_the_secret():
        async with open_channel(cluster["decode"], cluster["trust"]) as channel:
            stub = pb_grpc.DecodeServiceStub(channel)
            return await stub.GetAgentMetadata(pb.GetAgentMetadataRequest(), timeout=10), await stub.GetLoad(
                pb.GetLoadRequest(), timeout=10
            )

    agent, _ = asyncio.run(with_the_secret())
    assert agent.agent_name and agent.metadata
    # Each refusing server logged each caller once (not once per call).
    for role in ("decode", "prefill"):
        assert cluster["procs"][role].output().count("refused /pdserve.v1.") == 1


def completion(base: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def test_a_forged_prefill_writes_nothing_and_the_victims_stream_is_unchanged(cluster):
    """Issue 20's attack: a Prefill straight to the prefill server, no secret, into in-range decode
    pages and a made-up room, while a victim's stream runs through the router."""
    victim = [0] + list(range(30, 70))
    [want] = hf_greedy(cluster["model"], [victim], 40)
    bytes_before = metric(metrics(cluster["prefill_metrics"]), "pdserve_kv_transfer_bytes_total", role="prefill")
    got = {}
    thread = threading.Thread(target=lambda: got.update(tokens=completion(cluster["base"], victim, 40)))
    thread.start()
    try:
        request = pb.GenerateRequest(
            request_id="forged", prompt_token_ids=victim, params=params(4), bootstrap_room=random.getrandbits(63)
        )
        destination = pb.KVDestination(
            bootstrap_room=request.bootstrap_room, decode_agent_name="decode", page_ids=list(range(1, 39))
        )
        with grpc.insecure_channel(cluster["decode"]) as dch, grpc.insecure_channel(cluster["prefill"]) as pch:
            for attempt in (
                lambda: pb_grpc.DecodeServiceStub(dch).GetAgentMetadata(pb.GetAgentMetadataRequest(), timeout=10),
                lambda: pb_grpc.PrefillServiceStub(pch).Prefill(
                    pb.PrefillRequest(request=request, destination=destination), timeout=10
                ),
            ):
                with pytest.raises(grpc.RpcError) as refused:
                    attempt()
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        thread.join(TIMEOUT_S)
    assert got["tokens"] == want
    # The prefill server wrote the victim's pages and nothing else.
    info = asyncio.run(server_info(cluster["prefill"], cluster["trust"]))
    page_bytes = info.layout.page_size * info.layout.kv_heads * info.layout.head_dim * 4  # float32
    victim_bytes = 2 * info.layout.num_layers * pages_for(len(victim), info.layout.page_size) * page_bytes
    bytes_after = metric(metrics(cluster["prefill_metrics"]), "pdserve_kv_transfer_bytes_total", role="prefill")
    assert bytes_after - bytes_before == victim_bytes


async def server_info(address: str, trust) -> pb.ServerInfo:
    async with open_channel(address, trust) as channel:
        return await pb_grpc.PrefillServiceStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def test_forged_notifications_are_refused_counted_and_change_nothing(cluster):
    """Someone on the pod network who reached the decode server's UCX port with its agent metadata
    (here: handed over) notifies completions it never made: for a room never granted, and for the
    victim's own room with the wrong page or byte count, or garbage. The decode server counts and
    refuses each (logging the sender once); the victim then gets its real KV and answers exactly
    as transformers does."""
    from nixl._api import nixl_agent, nixl_agent_config

    from pdserve.common.kv_transfer.pool_metadata import decode_pool_metadata

    victim = [0] + list(range(100, 150))
    [want] = hf_greedy(cluster["model"], [victim], 12)
    trust = cluster["trust"]

    async def run():
        async with open_channel(cluster["decode"], trust) as dch, open_channel(cluster["prefill"], trust) as pch:
            decode = pb_grpc.DecodeServiceStub(dch)
            md = await decode.GetAgentMetadata(pb.GetAgentMetadataRequest(), timeout=10)
            [pool] = decode_pool_metadata(md.metadata)  # one TP rank
            forger = nixl_agent(
                f"forger-{secrets.token_hex(3)}", nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            )
            target = forger.add_remote_agent(pool.transport_metadata)
            target = target.decode() if isinstance(target, bytes) else target

            request = pb.GenerateRequest(
                request_id="victim", prompt_token_ids=victim, params=params(12), bootstrap_room=random.getrandbits(63)
            )
            call = decode.Generate(request, timeout=TIMEOUT_S)
            first = await call.read()
            dest = first.destination
            room, granted = dest.bootstrap_room, len(dest.page_ids)
            size = 2 * pool.layout.num_layers * granted * pool.layout.page_bytes
            forged = {
                "unknown_room": encode_notif(room ^ 1, 5, None, granted, size),
                "page_count": encode_notif(room, 5, None, granted - 1, size),
                "byte_count": encode_notif(room, 5, None, granted, size + 1),
                "malformed": b'{"v": 2, "room": 1}',
            }
            before = metrics(cluster["decode_metrics"])
            for notif in forged.values():
                forger.send_notif(target, notif)
            deadline = time.monotonic() + 20
            while True:
                forger.get_new_notifs()  # progresses the forger's UCX worker (no progress thread)
                now = metrics(cluster["decode_metrics"])
                delta = {
                    r: metric(now, "pdserve_kv_rejected_transfers_total", role="decode", reason=r)
                    - metric(before, "pdserve_kv_rejected_transfers_total", role="decode", reason=r)
                    for r in forged
                }
                if all(delta.values()) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            assert delta == dict.fromkeys(forged, 1.0)
            await asyncio.sleep(0.5)  # (GetLoad answers the scheduler's last report: they come every 0.2 s)
            load = await decode.GetLoad(pb.GetLoadRequest(), timeout=10)
            assert load.running_requests == 0 and load.inflight_transfers == 1, (
                "a forged notification started the victim"
            )

            answer = await pb_grpc.PrefillServiceStub(pch).Prefill(
                pb.PrefillRequest(request=request, destination=dest), timeout=TIMEOUT_S
            )
            assert not answer.HasField("error"), answer.error
            tokens = []
            while (msg := await call.read()) is not grpc.aio.EOF:
                if msg.WhichOneof("response") == "tokens":
                    tokens += msg.tokens.token_ids
            return tokens, forger.name

    tokens, forger_name = asyncio.run(run())
    assert tokens == want
    log = cluster["procs"]["decode"].output()
    assert log.count(f"refused a KV transfer notification from agent '{forger_name}'") == 1, log


# ---- the settings ------------------------------------------------------------------------------


def test_a_public_address_needs_a_secret(tiny_models, tmp_path):
    model = tiny_models("llama")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.decode.cli",
            "--model-path",
            model,
            "--device",
            "cpu",
            "--host",
            "0.0.0.0",
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert (
        "listening on 0.0.0.0 without a cluster secret or TLS" in out.stderr and "--cluster-secret-file" in out.stderr
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.router.cli",
            "--model-path",
            model,
            "--prefill",
            "10.1.2.3:30002",
            "--decode-dns",
            "pdserve-decode:30001",
            "--workers",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "reaching servers at 10.1.2.3, pdserve-decode without" in out.stderr, out.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.prefill.cli",
            "--model-path",
            model,
            "--device",
            "cpu",
            "--port",
            str(free_port()),
            "--cluster-secret-file",
            str(empty),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "is empty" in out.stderr, out.stderr


def test_trust_settings(tmp_path, monkeypatch):
    for host, loopback in (
        ("127.0.0.1", True),
        ("127.8.0.1", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.7", False),
        ("pdserve-decode", False),
    ):
        assert is_loopback(host) is loopback, host
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    none = load_trust(TrustConfig())
    assert not none.authenticated and check_exposure(none, ["127.0.0.1", "localhost"], "listening on") is None
    with pytest.raises(ValueError, match="--allow-unauthenticated"):
        check_exposure(none, ["127.0.0.1", "0.0.0.0"], "listening on")
    allowed = load_trust(TrustConfig(allow_unauthenticated=True))
    assert "(--allow-unauthenticated)" in check_exposure(allowed, ["0.0.0.0"], "listening on")

    rotation = tmp_path / "secrets"
    rotation.write_text("new-secret-0123456789\n\nold-secret-0123456789\n")
    trust = load_trust(TrustConfig(cluster_secret_file=str(rotation)))
    assert trust.secrets == ("new-secret-0123456789", "old-secret-0123456789") and trust.authenticated
    assert check_exposure(trust, ["0.0.0.0"], "listening on") is None
    short = tmp_path / "short"
    short.write_text("sekret")
    with pytest.raises(ValueError, match="at least 16"):
        load_trust(TrustConfig(cluster_secret_file=str(short)))
    with pytest.raises(ValueError, match="cannot read"):
        load_trust(TrustConfig(cluster_secret_file=str(tmp_path / "missing")))
    # The environment, for containers: a file path, else the secret itself; the flag wins.
    monkeypatch.setenv(SECRET_ENV, "from-the-environment-0123")
    assert load_trust(TrustConfig()).secrets == ("from-the-environment-0123",)
    monkeypatch.setenv(SECRET_FILE_ENV, str(rotation))
    assert load_trust(TrustConfig()).secrets[0] == "new-secret-0123456789"
    with pytest.raises(ValueError, match="go together"):
        load_trust(TrustConfig(tls_cert=str(rotation)))
    (tmp_path / "made").mkdir()
    made = write_secret_file(str(tmp_path / "made"))  # a fresh secret, this user's only
    assert oct(os.stat(made).st_mode & 0o777) == "0o600"
    assert len(load_trust(TrustConfig(cluster_secret_file=made)).secrets[0]) == 64  # the flag wins
    # A server accepts any line of its file (rotation), nothing else.
    check = ClusterSecretCheck(trust.secrets)
    for metadata, allowed in (
        (((SECRET_METADATA_KEY, "old-secret-0123456789"),), True),
        (((SECRET_METADATA_KEY, "new-secret-0123456789"),), True),
        (((SECRET_METADATA_KEY, "new-secret-012345678"),), False),
        (((SECRET_METADATA_KEY, ""),), False),
        ((("authorization", "new-secret-0123456789"),), False),
        ((), False),
    ):
        assert check.allows(metadata) is allowed, metadata


# ---- mutual TLS, with a throwaway CA ------------------------------------------------------------


def openssl(*args: str, cwd) -> None:
    out = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


def make_ca(directory, name: str) -> None:
    openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-days",
        "1",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        "-subj",
        f"/CN={name}",
        cwd=directory,
    )


def make_cert(directory, ca: str, name: str, san: str, usage: str) -> None:
    (directory / f"{name}.ext").write_text(f"subjectAltName={san}\nextendedKeyUsage={usage}\n")
    openssl(
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        f"/CN={name}",
        cwd=directory,
    )
    openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.pem",
        "-CAkey",
        f"{ca}.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-out",
        f"{name}.pem",
        "-extfile",
        f"{name}.ext",
        cwd=directory,
    )


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a throwaway CA")
def test_mutual_tls(tmp_path):
    """A server with --tls-* files takes calls only from a client whose certificate its CA signed,
    and the client checks the server's certificate (by the name it was given for it); the secret
    still rides on top."""
    make_ca(tmp_path, "ca")
    make_ca(tmp_path, "other-ca")
    make_cert(tmp_path, "ca", "server", "DNS:pdserve-decode", "serverAuth")
    make_cert(tmp_path, "ca", "router", "DNS:pdserve-router", "clientAuth")
    make_cert(tmp_path, "other-ca", "stranger", "DNS:stranger", "clientAuth")
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32))

    def trust(name: str, with_secret: bool = True, ca: str = "ca"):
        return load_trust(
            TrustConfig(
                cluster_secret_file=str(secret) if with_secret else "",
                tls_cert=str(tmp_path / f"{name}.pem"),
                tls_key=str(tmp_path / f"{name}.key"),
                tls_ca=str(tmp_path / f"{ca}.pem"),
            )
        )

    async def main():
        async def get_load(request, context):
            return pb.Load(running_requests=7)

        handler = grpc.method_handlers_generic_handler(
            "pdserve.v1.DecodeService",
            {
                "GetLoad": grpc.unary_unary_rpc_method_handler(
                    get_load, pb.GetLoadRequest.FromString, pb.Load.SerializeToString
                )
            },
        )
        server_trust = trust("server")
        server = grpc.aio.server(interceptors=server_interceptors(server_trust))
        server.add_generic_rpc_handlers((handler,))
        port = add_port(server, "127.0.0.1:0", server_trust)
        await server.start()
        outcomes = {}
        try:
            for label, client, name in (
                ("router", trust("router"), "pdserve-decode"),
                ("router, no secret", trust("router", with_secret=False), "pdserve-decode"),
                ("stranger", trust("stranger", ca="ca"), "pdserve-decode"),
                ("wrong server name", trust("router"), "pdserve-prefill"),
            ):
                async with open_channel(f"127.0.0.1:{port}", client, server_name=name) as channel:
                    try:
                        load = await pb_grpc.DecodeServiceStub(channel).GetLoad(pb.GetLoadRequest(), timeout=10)
                        outcomes[label] = load.running_requests
                    except grpc.aio.AioRpcError as e:
                        outcomes[label] = e.code()
        finally:
            await server.stop(None)
        return outcomes

    outcomes = asyncio.run(main())
    assert outcomes == {
        "router": 7,
        "router, no secret": grpc.StatusCode.UNAUTHENTICATED,
        "stranger": grpc.StatusCode.UNAVAILABLE,
        "wrong server name": grpc.StatusCode.UNAVAILABLE,
    }


# ---- the decode server's grant check, in process ----------------------------------------------


def test_decode_acts_only_on_notifications_matching_a_grant(tiny_models):
    """Exact bookkeeping without the network: refused notifications are counted by reason and leave
    the request waiting; the matching one starts it; a late copy of it (a retried prefill's) is
    neither acted on nor counted."""
    from pdserve.common.config import EngineConfig
    from pdserve.common.types import SamplingParams
    from pdserve.decode.engine import DecodeEngine

    engine = DecodeEngine(
        EngineConfig(model_path=tiny_models("llama"), device="cpu", max_total_tokens=1024, page_size=8),
        f"decode-grants-{secrets.token_hex(3)}",
    )
    try:
        engine.add_decode_request(list(range(20)), SamplingParams(max_new_tokens=3, temperature=0), room=41, rid="r")
        engine.pop_preallocated()
        [dest] = engine.destinations
        assert len(dest.page_ids) == 3 == engine.scheduler.granted_pages(41)
        size = engine.agent.layout.transfer_bytes(3)
        inbox = [
            ("forger", encode_notif(42, 5, None, 3, size)),
            ("forger", encode_notif(41, 5, None, 2, size)),
            ("prefill", encode_notif(41, 5, None, 3, size - 1)),
            ("forger", b"\x00junk"),
            ("forger", encode_notif(41, engine.vocab_size, None, 3, size)),
            ("forger", encode_notif(41, 5, {"token_id": 5}, 3, size)),
        ]
        engine.agent.get_notifs = lambda: [inbox.pop(0)] if inbox else []
        for _ in range(6):
            engine.pop_transferred()
        assert engine.rejected == {"unknown_room": 1, "page_count": 1, "byte_count": 1, "malformed": 3}
        assert 41 in engine.scheduler.transferring and not engine.scheduler.running and not engine.outputs
        assert engine._refused_peers == {"forger", "prefill"}

        inbox += [
            ("prefill", encode_notif(41, 5, None, 3, size)),
            ("prefill-retry", encode_notif(41, 5, None, 3, size)),
        ]
        engine.pop_transferred()
        assert [r.rid for r in engine.scheduler.running] == ["r"] and engine.scheduler.running[0].output_ids == [5]
        engine.pop_transferred()  # the late copy: granted once, already served
        assert engine.rejected == {"unknown_room": 1, "page_count": 1, "byte_count": 1, "malformed": 3}
        assert engine.scheduler.served == {41: 3}
        engine.abort("r")
        assert engine.is_idle()
    finally:
        engine.agent.close()


def test_the_rpc_auth_microbenchmark_runs(capsys):
    from pdserve.bench.micro.rpc_auth import main

    main(["--calls", "20", "--messages", "20", "--repeats", "1"])
    out = capsys.readouterr().out
    assert re.search(r"check +\d+\.\d+ us per RPC", out) and all(
        m in out for m in ("no secret", "secret", "client icpt")
    )
