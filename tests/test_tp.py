"""Tensor parallelism on CPU (gloo): tp=2 engines give transformers' greedy tokens.

Each engine here is two processes (rank 0 in the test process, rank 1 spawned by it). The prompts
cross page boundaries and Mistral's sliding window; chunked prefill (16-token chunks), the
overlapped and the serial loop, prefix-cache hits, KV heads replicated across ranks (1 KV head,
tp=2) and a vocab that 2 does not divide (509: the last rank's rows are padding) are all covered.
The loader's shards and the start-up checks are tested without processes.
"""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors import safe_open

from pdserve.common.config import EngineConfig
from pdserve.common.tiny_model import make_tiny_model
from pdserve.common.types import SamplingParams

PROMPT_LENS = [1, 5, 9, 16, 17, 33, 47, 50, 64, 70, 100, 120]
# name -> (arch, config overrides)
MODELS = {
    "llama": ("llama", None),
    "qwen3": ("qwen3", None),
    "gpt2": ("gpt2", None),
    # One KV head for two ranks (replicated) and a vocab split 255 + 254 (+1 padding row).
    "llama_kv1_vocab509": ("llama", {"num_key_value_heads": 1, "vocab_size": 509}),
}
TP_ENGINE = dict(
    device="cpu", tp_size=2, max_total_tokens=8192, chunked_prefill_size=16, page_size=4, max_running_requests=8
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_models):
    """name -> checkpoint directory."""
    root = tmp_path_factory.mktemp("tp")
    built = {}

    def get(name: str) -> str:
        arch, overrides = MODELS[name]
        if name not in built:
            built[name] = (
                tiny_models(arch) if overrides is None else str(make_tiny_model(root / name, arch, 0, overrides))
            )
        return built[name]

    return get


def hf_cases(path: str) -> list[tuple[list[int], int, list[int]]]:
    """(prompt ids, max_new_tokens, transformers' greedy output ids) for PROMPT_LENS."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    rng = random.Random(7)
    cases = []
    for n in PROMPT_LENS:
        ids = [0] + [rng.randrange(5, hf.config.vocab_size) for _ in range(n - 1)]
        max_new = rng.randint(4, 16)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, pad_token_id=2)
        cases.append((ids, max_new, out[0, len(ids) :].tolist()))
    return cases


def engines_ending_idle(defaults: dict):
    """An Engine factory (a model path, flags over `defaults`) for a fixture to yield from: once the
    test is done every engine it made must be idle, is closed, and its other TP ranks have exited."""
    from pdserve.common.engine.engine import Engine

    engines = []

    def make(path, **overrides):
        engine = Engine(model_path=str(path), **{**defaults, **overrides})
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        idle = engine.is_idle()
        procs = engine.tp_workers.procs if engine.tp_workers is not None else []
        engine.close()
        assert all(p.poll() is not None for p in procs), "a TP rank outlived its engine"
        assert idle, f"KV leaked: {engine.stats()}"


@pytest.fixture
def tp_engine(checkpoints):
    """Engine factory by checkpoint name (engines_ending_idle)."""
    engines = engines_ending_idle(TP_ENGINE)
    make = next(engines)
    yield lambda name, **overrides: make(checkpoints(name), **overrides)
    next(engines, None)


def greedy(cases):
    return [SamplingParams(max_new_tokens=n, temperature=0) for _, n, _ in cases]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tp2_greedy_matches_transformers_with_chunks_and_prefix_hits(checkpoints, tp_engine, name):
    cases = hf_cases(checkpoints(name))
    engine = tp_engine(name)
    kv_heads = {"llama": 1, "qwen3": 1, "gpt2": 2, "llama_kv1_vocab509": 1}[name]
    assert engine.runner.kv_pool.kv_heads == kv_heads, "each rank's pool holds its KV heads only"
    outs = engine.generate([ids for ids, _, _ in cases], greedy(cases))
    assert [o.output_ids for o in outs] == [expected for _, _, expected in cases]
    assert engine.scheduler.stats["prefill_chunks"] > 0
    # Again: the prompts' prefixes now come from the radix cache.
    hits = engine.scheduler.stats["cache_hit_tokens"]
    outs = engine.generate([ids for ids, _, _ in cases], greedy(cases))
    assert [o.output_ids for o in outs] == [expected for _, _, expected in cases]
    assert engine.scheduler.stats["cache_hit_tokens"] > hits and sum(o.cached_tokens for o in outs) > 0


def test_tp2_serial_loop_matches_transformers_and_seeded_sampling_matches_tp1(checkpoints, tp_engine, make_engine):
    cases = hf_cases(checkpoints("llama"))
    engine = tp_engine("llama", disable_overlap_schedule=True)
    outs = engine.generate([ids for ids, _, _ in cases], greedy(cases))
    assert [o.output_ids for o in outs] == [expected for _, _, expected in cases]
    # Rank 0 samples from the gathered logits with the request's seed: the same draws as tp=1.
    sampled = [SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=i) for i in range(len(cases))]
    single = make_engine("llama", max_total_tokens=8192)
    prompts = [ids for ids, _, _ in cases]
    assert [o.output_ids for o in engine.generate(prompts, sampled)] == [
        o.output_ids for o in single.generate(prompts, sampled)
    ]
    # Prompt logprobs: every rank runs the same scoring forward (its LM head all-gathers); chunked.
    scored = [SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=2)] * len(prompts)
    for tp2, tp1 in zip(engine.generate(prompts, scored), single.generate(prompts, scored)):
        assert len(tp2.prompt_logprobs) == len(tp2.prompt_ids)
        for a, b in zip(tp2.prompt_logprobs[1:], tp1.prompt_logprobs[1:]):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4 and a.rank == b.rank
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_tp2_run_batch_matches_transformers(checkpoints, tmp_path):
    path = checkpoints("llama_kv1_vocab509")
    cases = hf_cases(path)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with open(src, "w") as f:
        for i, (ids, max_new, _) in enumerate(cases):
            body = {"prompt": ids, "max_tokens": max_new, "temperature": 0, "return_token_ids": True}
            f.write(json.dumps({"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    cmd = [
        sys.executable,
        "-m",
        "pdserve.common.cli",
        "run-batch",
        "-i",
        str(src),
        "-o",
        str(dst),
        "--model-path",
        path,
        "--device",
        "cpu",
        "--tp-size",
        "2",
        "--max-running-requests",
        "5",
        "--max-total-tokens",
        "8192",
    ]
    subprocess.run(cmd, check=True, timeout=300)
    lines = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [line["response"]["body"]["choices"][0]["token_ids"] for line in lines] == [e for _, _, e in cases]


def test_a_rank_that_dies_mid_generation_fails_the_engine_at_once(checkpoints):
    from pdserve.common.engine.engine import Engine

    engine = Engine(model_path=checkpoints("llama"), **TP_ENGINE)  # left broken: not the fixture's
    rank1 = engine.tp_workers.procs[0]
    killer = threading.Timer(0.3, rank1.kill)
    killer.start()
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="TP rank 1 exited"):
            engine.generate([[0, 7, 8, 9]] * 4, SamplingParams(max_new_tokens=1000, ignore_eos=True))
        assert time.monotonic() - start < 10
    finally:
        killer.join()
        engine.close()


def test_the_other_ranks_exit_when_rank_0_dies(checkpoints, tmp_path):
    script = (
        "import os, signal, sys\n"
        "from pdserve.common.engine.engine import Engine\n"
        f"e = Engine(model_path={checkpoints('llama')!r}, device='cpu', tp_size=2, max_total_tokens=4096)\n"
        "print(e.tp_workers.procs[0].pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    rank1 = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 10
    while alive(rank1):
        assert time.monotonic() < deadline, "rank 1 outlived rank 0 by 10 s"
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


# ---- without processes ------------------------------------------------------------------------


def test_heads_are_split_or_replicated_per_rank():
    from pdserve.common.engine.models.parallel import heads_of_rank, vocab_part
    from pdserve.common.engine.tp import TPGroup

    def ranks(n, tp):
        return [heads_of_rank(n, TPGroup(r, tp, torch.device("cpu"))) for r in range(tp)]

    assert ranks(4, 2) == [range(0, 2), range(2, 4)]
    assert ranks(2, 4) == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]  # replicated KV heads
    assert ranks(1, 2) == [range(0, 1), range(0, 1)]
    assert [vocab_part(509, TPGroup(r, 2, torch.device("cpu"))) for r in range(2)] == [(0, 255), (255, 510)]


def test_an_nccl_abort_that_never_returns_holds_rank_0_no_longer_than_its_bound():
    """ProcessGroupNCCL.abort with a dead peer can block past its own timeout (seen on two H200s):
    TPGroup.abort gives up waiting after `wait_s` and leaves it on a daemon thread."""
    from pdserve.common.engine.tp import TPGroup

    class HungBackend:
        def __init__(self):
            self.entered, self.release, self.timeout = threading.Event(), threading.Event(), None

        def _set_default_timeout(self, timeout):
            self.timeout = timeout

        def abort(self):
            self.entered.set()
            self.release.wait()

    backend = HungBackend()
    started = time.monotonic()
    TPGroup(0, 2, torch.device("cuda"), backend).abort(0.3)
    assert backend.entered.is_set() and backend.timeout.total_seconds() == 0.3
    assert 0.25 < time.monotonic() - started < 5
    backend.release.set()
    gloo = HungBackend()
    TPGroup(0, 2, torch.device("cpu"), gloo).abort(0.3)  # gloo: nothing to abort
    assert not gloo.entered.is_set()


@pytest.mark.parametrize("name", ["llama_kv1_vocab509", "gpt2"])
def test_each_rank_loads_only_its_slices(checkpoints, name):
    from pdserve.common.engine.models.loader import load_model
    from pdserve.common.engine.tp import TPGroup

    path = checkpoints(name)
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        full = {k: f.get_tensor(k) for k in f.keys()}
    rank1 = load_model(path, torch.float32, "cpu", TPGroup(1, 2, torch.device("cpu")))  # no collectives run
    params = dict(rank1.named_parameters())
    if name == "gpt2":  # Conv1D [in, out]; q, k, v blocks of 64 each: rank 1 has columns 32..64 of each
        w = full["transformer.h.0.attn.c_attn.weight"].t()
        assert torch.equal(params["transformer.h.0.attn.c_attn.weight"], torch.cat([w[32:64], w[96:128], w[160:192]]))
        assert torch.equal(
            params["transformer.h.0.attn.c_proj.weight"], full["transformer.h.0.attn.c_proj.weight"].t()[:, 32:64]
        )
        assert not params["transformer.h.0.attn.c_proj.bias"].any(), "a row-parallel bias is rank 0's alone"
        assert torch.equal(params["transformer.wte.weight"], full["transformer.wte.weight"][256:512])
        return
    head = 16
    assert torch.equal(
        params["model.layers.0.self_attn.q_proj.weight"], full["model.layers.0.self_attn.q_proj.weight"][2 * head :]
    )
    assert torch.equal(
        params["model.layers.0.self_attn.k_proj.weight"], full["model.layers.0.self_attn.k_proj.weight"]
    )  # the one KV head
    assert torch.equal(
        params["model.layers.0.self_attn.o_proj.weight"], full["model.layers.0.self_attn.o_proj.weight"][:, 2 * head :]
    )
    assert torch.equal(
        params["model.layers.0.mlp.down_proj.weight"], full["model.layers.0.mlp.down_proj.weight"][:, 64:]
    )
    embed = params["model.embed_tokens.weight"]
    assert (
        embed.shape[0] == 255
        and torch.equal(embed[:254], full["model.embed_tokens.weight"][255:])
        and not embed[254].any()
    )
    assert torch.equal(params["lm_head.weight"][:254], full["lm_head.weight"][255:])


def test_a_tp_size_the_model_or_the_machine_cannot_take_is_refused_at_start(tiny_models):
    path = tiny_models("llama")  # 4 heads, 2 KV heads, MLP 128
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        EngineConfig(model_path=path, device="cpu", tp_size=3).resolve()
    with pytest.raises(ValueError, match="attention heads"):
        EngineConfig(model_path=path, device="cpu", tp_size=8).resolve()
    with pytest.raises(ValueError, match="--tp-size must be >= 1"):
        EngineConfig(model_path=path, device="cpu", tp_size=0).resolve()
    assert EngineConfig(model_path=path, device="cpu", tp_size=4).resolve().tp_size == 4  # 2 KV heads, replicated
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="one per rank"):
            EngineConfig(model_path=path, device="cuda", tp_size=2).resolve()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_server_whose_tp_size_does_not_divide_the_model_refuses_to_start(tiny_models, role):
    cmd = [
        sys.executable,
        "-m",
        f"pdserve.{role}.cli",
        "--model-path",
        tiny_models("llama"),
        "--device",
        "cpu",
        "--port",
        "1",
        "--tp-size",
        "3",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--tp-size 3 does not divide the model's 4 attention heads" in proc.stderr


def test_tp2_grammar_outputs_equal_tp1_in_the_overlap_loop(checkpoints, tp_engine, make_engine):
    """Rank 0 samples under the grammar once the previous step is processed (a deferred sampling);
    the other ranks wait for its ids in the broadcast, as for every step."""
    from tests.test_grammar import _batch

    prompts = [ids for ids, _, _ in hf_cases(checkpoints("llama"))][:4]
    params = _batch(len(prompts), max_new_tokens=60)
    tp2 = tp_engine("llama").generate(prompts, params)
    tp1 = make_engine("llama", max_total_tokens=8192).generate(prompts, params)
    assert [o.output_ids for o in tp2] == [o.output_ids for o in tp1]
    assert all(o.finish_reason.value == "stop" for o in tp2)


def test_symmetric_memory_that_cannot_be_set_up_leaves_nccl_in_charge(caplog, monkeypatch):
    """--tp-all-reduce symm where torch's symmetric memory cannot be had (here: a CPU group): setup
    warns and returns None on every rank (they agree through the store), and it is tried once per
    process: a second engine's rank 0 tells its ranks NCCL (an empty name) without trying."""
    from pdserve.common.engine import tp_symmetric
    from pdserve.common.engine.tp import TPGroup
    from pdserve.common.engine.tp_symmetric import NAME_KEY, SymmetricAllReduce

    class Store(dict):
        def set(self, key, value):
            self[key] = value.encode() if isinstance(value, str) else value

        def get(self, key):
            return self[key]

    monkeypatch.setattr(tp_symmetric, "_SET_UP", False)
    store = Store()
    group = TPGroup(0, 2, torch.device("cpu"), object(), store)
    with caplog.at_level("WARNING"):
        assert SymmetricAllReduce.setup(group, 1024, torch.float32) is None
    name = store[NAME_KEY].decode()
    assert name and store[f"{name}-set-up-0"] == b"0" and "not used" in caplog.text
    assert group.symmetric is None
    caplog.clear()
    second = Store()
    with caplog.at_level("WARNING"):
        assert SymmetricAllReduce.setup(TPGroup(0, 2, torch.device("cpu"), object(), second), 64, torch.float32) is None
    assert second[NAME_KEY] == b"" and "once per process" in caplog.text
