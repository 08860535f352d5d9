"""The gRPC contract (proto/pdserve.proto): generated code in sync, a real grpc.aio round trip,
message round trips (optional presence, oneofs), and every element of the .proto commented."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.proto import generate
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc

TIMEOUT_S = 5.0


# ---------------------------------------------------------------------------------------------
# (a) generated code in sync with the .proto
# ---------------------------------------------------------------------------------------------


def test_generated_code_in_sync():
    generated = generate.generate()  # protoc into a temp dir
    stale = generate.stale(generated)
    assert not stale, (
        "proto/ generated code is stale; run `python -m pdserve.proto.generate`\n" + generate.diff_summary(generated)
    )


def test_check_cli_passes_when_in_sync():
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.proto.generate", "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_cli_fails_on_unregenerated_change(tmp_path):
    """The checker itself: an edited .proto next to the old generated files must be caught."""
    for name in generate.OUTPUTS:
        shutil.copyfile(generate.HERE / name, tmp_path / name)
    proto = tmp_path / "pdserve.proto"
    text = generate.PROTO.read_text()
    proto.write_text(text.replace("message Usage {", "message Usage {\n  // New.\n  uint32 extra = 99;", 1))
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.proto.generate", "--check", "--proto", str(proto), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "pdserve_pb2.py: differs" in result.stderr
    assert "pdserve_pb2.pyi: differs" in result.stderr
    # Regenerating fixes it, and a second run changes nothing (idempotent).
    assert generate.main(["--proto", str(proto), "--out", str(tmp_path)]) == 0
    assert generate.write(generate.generate(proto), tmp_path) == []
    assert generate.main(["--check", "--proto", str(proto), "--out", str(tmp_path)]) == 0


def test_generated_grpc_module_imports_pb2_from_the_package():
    src = (generate.HERE / "pdserve_pb2_grpc.py").read_text()
    assert "from pdserve.proto import pdserve_pb2 as" in src
    assert "\nimport pdserve_pb2" not in src
    assert pb.DESCRIPTOR.name == "pdserve/proto/pdserve.proto"
    assert pb.DESCRIPTOR.package == "pdserve.v1"


# ---------------------------------------------------------------------------------------------
# (b) a real grpc.aio round trip: fake DecodeService + standard health service
# ---------------------------------------------------------------------------------------------

LAYOUT = pb.KVLayout(page_size=16, num_layers=2, kv_heads=4, head_dim=64, dtype="bfloat16", num_pages=1024)


class FakeDecode(pb_grpc.DecodeServiceServicer):
    """Streams destination -> two token chunks -> finish, echoing what it received."""

    def __init__(self):
        self.requests: list[pb.GenerateRequest] = []
        self.aborted: list[str] = []

    async def Generate(self, request, context):
        self.requests.append(request)
        if not request.prompt_token_ids:
            yield pb.GenerateResponse(error=pb.Error(code=pb.Error.INVALID_REQUEST, message="empty prompt"))
            return
        n_pages = -(-len(request.prompt_token_ids) // LAYOUT.page_size)
        yield pb.GenerateResponse(
            destination=pb.KVDestination(
                bootstrap_room=request.bootstrap_room,
                decode_agent_name="decode-0",
                decode_agent_metadata=b"\x00nixl\xff",
                page_ids=list(range(1, 1 + n_pages)),
                layout=LAYOUT,
            )
        )
        with_lp = request.params.HasField("logprobs")
        yield pb.GenerateResponse(
            tokens=pb.TokenChunk(
                token_ids=[7],
                logprobs=[pb.TokenLogprob(token_id=7, logprob=-0.5, top=[pb.TopLogprob(token_id=7, logprob=-0.5)])]
                if with_lp
                else [],
                index=0,
            )
        )
        yield pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=[8, 2], index=1))
        yield pb.GenerateResponse(
            finish=pb.FinishInfo(
                reason=pb.FINISH_REASON_STOP,
                token_id=2,
                usage=pb.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=3),
            )
        )

    async def Abort(self, request, context):
        self.aborted.append(request.request_id)
        return pb.AbortResponse(found=request.request_id == "known")

    async def GetServerInfo(self, request, context):
        return pb.ServerInfo(role=pb.ServerInfo.DECODE, served_model_name="tiny", layout=LAYOUT)


async def _read_all(call) -> list[pb.GenerateResponse]:
    out = []
    while True:
        msg = await asyncio.wait_for(call.read(), TIMEOUT_S)
        if msg is grpc.aio.EOF:
            return out
        out.append(msg)
        assert len(out) < 100, "stream does not end"


async def _round_trip():
    server = grpc.aio.server()
    fake = FakeDecode()
    pb_grpc.add_DecodeServiceServicer_to_server(fake, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service_name = pb.DESCRIPTOR.services_by_name["DecodeService"].full_name
    await health_servicer.set(service_name, health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port > 0
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await asyncio.wait_for(channel.channel_ready(), TIMEOUT_S)
            health_stub = health_pb2_grpc.HealthStub(channel)
            for name in ("", service_name):
                reply = await health_stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=TIMEOUT_S)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, name

            stub = pb_grpc.DecodeServiceStub(channel)
            request = pb.GenerateRequest(
                request_id="r1",
                prompt_token_ids=list(range(40)),
                params=pb.SamplingParams(max_new_tokens=3, temperature=0.0, seed=0, logprobs=1),
                bootstrap_room=(1 << 63) - 1,
            )
            call = stub.Generate(request, timeout=TIMEOUT_S)
            messages = await _read_all(call)
            assert await call.code() == grpc.StatusCode.OK

            kinds = [m.WhichOneof("response") for m in messages]
            assert kinds == ["destination", "tokens", "tokens", "finish"]
            dest = messages[0].destination
            assert dest.bootstrap_room == (1 << 63) - 1
            assert list(dest.page_ids) == [1, 2, 3]  # 40 tokens / 16 per page
            assert dest.decode_agent_metadata == b"\x00nixl\xff"
            assert dest.layout == LAYOUT
            tokens = [t for m in messages[1:3] for t in m.tokens.token_ids]
            assert tokens == [7, 8, 2]
            assert [m.tokens.index for m in messages[1:3]] == [0, 1]
            assert messages[1].tokens.logprobs[0].top[0].token_id == 7
            finish = messages[3].finish
            assert finish.reason == pb.FINISH_REASON_STOP
            assert finish.WhichOneof("matched_stop") == "token_id" and finish.token_id == 2
            assert finish.usage.prompt_tokens == 40 and finish.usage.completion_tokens == 3

            # What the server received: seed=0 and logprobs=0-or-more keep their presence.
            got = fake.requests[0]
            assert got == request
            assert got.params.HasField("seed") and got.params.seed == 0
            assert got.params.HasField("logprobs")
            assert not got.HasField("deadline_unix_s")

            # In-band error: the only message, and the call itself still succeeds.
            call = stub.Generate(pb.GenerateRequest(request_id="bad"), timeout=TIMEOUT_S)
            messages = await _read_all(call)
            assert [m.WhichOneof("response") for m in messages] == ["error"]
            assert messages[0].error.code == pb.Error.INVALID_REQUEST
            assert await call.code() == grpc.StatusCode.OK

            # Unary calls.
            assert (await stub.Abort(pb.AbortRequest(request_id="known"), timeout=TIMEOUT_S)).found
            assert not (await stub.Abort(pb.AbortRequest(request_id="other"), timeout=TIMEOUT_S)).found
            assert fake.aborted == ["known", "other"]
            info = await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=TIMEOUT_S)
            assert info.role == pb.ServerInfo.DECODE and info.layout.page_size == 16
            # Not implemented by the fake: the generated base class answers UNIMPLEMENTED.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetLoad(pb.GetLoadRequest(), timeout=TIMEOUT_S)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED

            await health_servicer.enter_graceful_shutdown()
            reply = await health_stub.Check(health_pb2.HealthCheckRequest(service=service_name), timeout=TIMEOUT_S)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await server.stop(grace=None)


def test_grpc_aio_round_trip():
    asyncio.run(asyncio.wait_for(_round_trip(), 4 * TIMEOUT_S))


# ---------------------------------------------------------------------------------------------
# (c) message round trips
# ---------------------------------------------------------------------------------------------


def _rt(msg):
    data = msg.SerializeToString()
    back = type(msg).FromString(data)
    assert back == msg
    return back


def test_sampling_params_optional_presence():
    empty = _rt(pb.SamplingParams(max_new_tokens=4))
    assert not empty.HasField("seed") and not empty.HasField("logprobs")
    # Zero is a value, not absence, for `optional` fields...
    zero = _rt(pb.SamplingParams(max_new_tokens=4, seed=0, logprobs=0))
    assert zero.HasField("seed") and zero.seed == 0
    assert zero.HasField("logprobs") and zero.logprobs == 0
    big = _rt(pb.SamplingParams(seed=2**64 - 1))
    assert big.seed == 2**64 - 1
    # ...and clearing brings absence back.
    zero.ClearField("seed")
    assert not _rt(zero).HasField("seed")
    # Plain proto3 scalars have no presence: they are taken literally.
    with pytest.raises(ValueError):
        pb.SamplingParams().HasField("temperature")


def test_sampling_params_all_fields():
    params = pb.SamplingParams(
        max_new_tokens=128,
        min_new_tokens=2,
        temperature=0.7,
        top_p=0.9,
        top_k=-1,
        min_p=0.05,
        seed=1234,
        repetition_penalty=1.1,
        frequency_penalty=-0.5,
        presence_penalty=0.5,
        stop=["\n\n", "END"],
        stop_token_ids=[2, 32000],
        ignore_eos=True,
        include_stop_str_in_output=True,
        logprobs=5,
        skip_special_tokens=True,
        prompt_logprobs=2,
        logit_bias=[pb.LogitBias(token_id=7, bias=-100.0), pb.LogitBias(token_id=2**32 - 1, bias=2.5)],
        grammar=pb.Grammar(kind="json_schema", spec='{"type": "object"}'),
        resumed_output_tokens=3,
    )
    back = _rt(params)
    assert (back.grammar.kind, back.grammar.spec) == ("json_schema", '{"type": "object"}')
    # Doubles: a Python float survives exactly.
    assert back.temperature == 0.7 and back.top_p == 0.9 and back.repetition_penalty == 1.1
    assert back.top_k == -1
    assert list(back.stop) == ["\n\n", "END"]
    # Every field is set to a non-default value above (none forgotten).
    assert {f.name for f, _ in back.ListFields()} == {f.name for f in pb.SamplingParams.DESCRIPTOR.fields}


def test_generate_request_round_trip():
    req = pb.GenerateRequest(
        request_id="cmpl-1",
        prompt_token_ids=[1, 2**32 - 1],
        params=pb.SamplingParams(max_new_tokens=1),
        bootstrap_room=(1 << 63) - 1,
        deadline_unix_s=1.7e9 + 0.25,
    )
    back = _rt(req)
    assert back.HasField("deadline_unix_s") and back.deadline_unix_s == 1.7e9 + 0.25
    assert not _rt(pb.GenerateRequest(request_id="x")).HasField("deadline_unix_s")
    assert not _rt(pb.GenerateRequest(request_id="x")).HasField("params")
    prefill = _rt(pb.PrefillRequest(request=req, destination=pb.KVDestination(bootstrap_room=req.bootstrap_room)))
    assert prefill.request.bootstrap_room == prefill.destination.bootstrap_room


def test_generate_response_oneof():
    cases = {
        "destination": pb.GenerateResponse(destination=pb.KVDestination(page_ids=[1, 2], layout=LAYOUT)),
        "tokens": pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=[5], index=3)),
        "finish": pb.GenerateResponse(finish=pb.FinishInfo(reason=pb.FINISH_REASON_LENGTH)),
        "error": pb.GenerateResponse(error=pb.Error(code=pb.Error.KV_TRANSFER_TIMEOUT, message="t")),
    }
    for kind, msg in cases.items():
        assert _rt(msg).WhichOneof("response") == kind
    # An empty sub-message still selects its branch on the wire.
    assert _rt(pb.GenerateResponse(tokens=pb.TokenChunk())).WhichOneof("response") == "tokens"
    # Setting another branch replaces the first.
    msg = pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=[1]))
    msg.error.code = pb.Error.INTERNAL
    assert _rt(msg).WhichOneof("response") == "error" and not msg.HasField("tokens")
    assert pb.GenerateResponse().WhichOneof("response") is None


def test_finish_matched_stop_oneof():
    assert _rt(pb.FinishInfo(reason=pb.FINISH_REASON_LENGTH)).WhichOneof("matched_stop") is None
    by_id = _rt(pb.FinishInfo(reason=pb.FINISH_REASON_STOP, token_id=0))  # id 0 is still a match
    assert by_id.WhichOneof("matched_stop") == "token_id" and by_id.token_id == 0
    by_text = _rt(pb.FinishInfo(reason=pb.FINISH_REASON_STOP, text=""))
    assert by_text.WhichOneof("matched_stop") == "text"
    by_text.token_id = 9
    assert by_text.WhichOneof("matched_stop") == "token_id"


def test_prefill_response_and_handshake_round_trip():
    resp = _rt(
        pb.PrefillResponse(
            first_token_id=42,
            cached_tokens=16,
            prompt_tokens=40,
            timings=pb.Timings(queue_s=0.001, prefill_s=0.02, transfer_s=0.003, transfer_bytes=2**40),
        )
    )
    assert not resp.HasField("first_logprob") and not resp.HasField("error")
    assert resp.timings.transfer_bytes == 2**40
    with_lp = _rt(pb.PrefillResponse(first_token_id=42, first_logprob=pb.TokenLogprob(token_id=42, logprob=-0.25)))
    assert with_lp.HasField("first_logprob") and with_lp.first_logprob.logprob == -0.25
    failed = _rt(pb.PrefillResponse(error=pb.Error(code=pb.Error.KV_TRANSFER_FAILED, message="peer gone")))
    assert failed.HasField("error") and failed.error.code == pb.Error.KV_TRANSFER_FAILED
    meta = _rt(pb.AgentMetadata(agent_name="prefill-0", metadata=bytes(range(256)) * 64, layout=LAYOUT))
    assert meta.metadata == bytes(range(256)) * 64
    load = _rt(pb.Load(running_requests=3, waiting_requests=1, kv_used_tokens=10**10, kv_total_tokens=2**40))
    assert load.kv_used_tokens == 10**10


def test_services_shape():
    services = pb.DESCRIPTOR.services_by_name
    assert set(services) == {"DecodeService", "PrefillService"}
    common = {"Abort", "GetLoad", "GetServerInfo", "GetAgentMetadata"}
    assert set(services["DecodeService"].methods_by_name) == common | {"Generate", "GenerateMany"}
    assert set(services["PrefillService"].methods_by_name) == common | {"Prefill", "PrefillStreamed"}
    generate_rpc = services["DecodeService"].methods_by_name["Generate"]
    assert generate_rpc.server_streaming and not generate_rpc.client_streaming
    assert generate_rpc.output_type.name == "GenerateResponse"
    streamed = services["PrefillService"].methods_by_name["PrefillStreamed"]
    assert streamed.client_streaming and not streamed.server_streaming
    assert (streamed.input_type.name, streamed.output_type.name) == ("PrefillRequest", "PrefillResponse")
    many = services["DecodeService"].methods_by_name["GenerateMany"]
    assert many.client_streaming and many.server_streaming
    assert (many.input_type.name, many.output_type.name) == ("GenerateManyRequest", "GenerateManyResponse")
    for svc in services.values():
        for m in svc.methods:
            if m.name not in ("Generate", "PrefillStreamed", "GenerateMany"):
                assert not m.server_streaming and not m.client_streaming, m.full_name


# ---------------------------------------------------------------------------------------------
# Style: every message, field, enum, enum value, oneof, service and rpc carries a comment
# ---------------------------------------------------------------------------------------------


def test_every_element_commented(tmp_path):
    import subprocess
    import sys

    from google.protobuf import descriptor_pb2

    out = tmp_path / "set.pb"
    # protoc in a child process: its native module can crash a process that already loaded torch
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{generate.HERE}",
        f"--descriptor_set_out={out}",
        "--include_source_info",
        "pdserve.proto",
    ]
    assert subprocess.run(cmd, timeout=120).returncode == 0
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    [fd] = fds.file
    commented = {
        tuple(loc.path)
        for loc in fd.source_code_info.location
        if (loc.leading_comments or loc.trailing_comments).strip()
    }
    # Field numbers of descriptor.proto: FileDescriptorProto.message_type=4, enum_type=5, service=6;
    # DescriptorProto.field=2, nested_type=3, enum_type=4, oneof_decl=8; EnumDescriptorProto.value=2;
    # ServiceDescriptorProto.method=2.
    missing = []

    def enum(path, e, name):
        if path not in commented:
            missing.append(name)
        for i, v in enumerate(e.value):
            if path + (2, i) not in commented:
                missing.append(f"{name}.{v.name}")

    def message(path, m, name):
        if path not in commented:
            missing.append(name)
        for i, f in enumerate(m.field):
            if path + (2, i) not in commented:
                missing.append(f"{name}.{f.name}")
        for i, o in enumerate(m.oneof_decl):
            # proto3 `optional` fields get a synthetic oneof named _<field>; it has no source.
            if not o.name.startswith("_") and path + (8, i) not in commented:
                missing.append(f"{name}.{o.name} (oneof)")
        for i, n in enumerate(m.nested_type):
            if n.options.map_entry:  # a map field's synthetic entry message (the field is commented)
                continue
            message(path + (3, i), n, f"{name}.{n.name}")
        for i, e in enumerate(m.enum_type):
            enum(path + (4, i), e, f"{name}.{e.name}")

    for i, m in enumerate(fd.message_type):
        message((4, i), m, m.name)
    for i, e in enumerate(fd.enum_type):
        enum((5, i), e, e.name)
    for i, s in enumerate(fd.service):
        if (6, i) not in commented:
            missing.append(s.name)
        for j, rpc in enumerate(s.method):
            if (6, i, 2, j) not in commented:
                missing.append(f"{s.name}.{rpc.name}")
    assert not missing, f"uncommented in pdserve.proto: {missing}"


def test_error_codes_are_the_protos():
    """The engine's ErrorCode and the proto's Error.Code name the same codes: a code crosses the
    ipc channel, the gRPC answer and the router by name."""
    from pdserve.common.errors import ErrorCode
    from pdserve.common.serving.frontend import error_to_proto

    assert {c.value for c in ErrorCode} == set(pb.Error.Code.keys()) - {"CODE_UNSPECIFIED"}
    for code in ErrorCode:
        assert pb.Error.Code.Name(error_to_proto(code, "x").code) == code.value
    assert error_to_proto(None, "x").code == pb.Error.INTERNAL
