"""The FP8 KV cache (`--kv-cache-dtype fp8_e4m3`) through the engine, on CPU: tiny Llama and GPT-2,
the torch-native backend and the Triton kernels (interpreted), overlap on and off; the pool's
dtype and capacity; checkpoint scales; disaggregated prefill -> decode with FP8 KV on both sides.

The yardstick is a plain reference computed here with torch's float8 casts: the unquantized engine
whose stored K and V are rounded through float8 with the FP8 engine's own scales. Agreement is the
share of positions whose top-1 token is the unquantized engine's: teacher-forced over the prompts
(extend), and over each engine's own greedy continuation (decode), scored by the unquantized one.
"""

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.common.config import EngineConfig
from pdserve.common.engine.engine import Engine
from pdserve.common.scheduling.batch import ForwardMode
from pdserve.common.types import SamplingParams
from tests.test_disagg_engines import drive, engines
from tests.test_fp8_weights import write_fp8_checkpoint
from tests.test_prefix_transfers import MAX_NEW, PAGE, conversations, next_turns

FP8 = torch.float8_e4m3fn
rng = random.Random(0)
PROMPTS = [[rng.randrange(5, 512) for _ in range(40)] for _ in range(6)]
NEW_TOKENS = 8
# The Triton kernels run interpreted on the CPU, one program after another: a third of the prompts
# (still a batch, still three chunks each) keeps their cases to seconds.
TRITON_PROMPTS = PROMPTS[:2]


def prompts_for(backend: str) -> list[list[int]]:
    return TRITON_PROMPTS if backend == "triton" else PROMPTS


# Prompts in chunks of 16: a prompt's own tokens attend to each other through their K and V as
# computed (only the prefix is read through float8), so one chunk would leave the prompt logprobs
# unquantized; in chunks, the later ones read the earlier ones' float8 K and V.
CHUNK = 16


def engine_for(path, **overrides) -> Engine:
    defaults = {"device": "cpu", "max_total_tokens": 4096, "chunked_prefill_size": CHUNK}
    return Engine(model_path=str(path), **(defaults | overrides))


def fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x rounded through float8 e4m3 with `scale`, by plain torch casts (448: e4m3's largest value)."""
    return ((x.float() / scale).clamp(-448, 448).to(FP8).float() * scale).to(x.dtype)


def reference_engine(path, k_scales, v_scales, **overrides) -> Engine:
    """The unquantized engine whose pool keeps K and V rounded through float8 with these scales,
    but for a prefill's new tokens, which its attention reads as computed (stored exactly first,
    rounded after)."""
    engine = engine_for(path, **overrides)
    pool, attn = engine.runner.kv_pool, engine.runner.attn
    assert not pool.quantized and attn.fuses_rope_and_store is False
    store, attend = pool.set_kv, attn.forward

    def set_kv(layer, loc, k, v):
        store(layer, loc, fake_quant(k, k_scales[layer]), fake_quant(v, v_scales[layer]))

    def forward(q, k, v, layer_id, batch, scale, sliding_window=None, kv_stored=False):
        if batch.mode is ForwardMode.DECODE:
            set_kv(layer_id, batch.out_cache_loc, k, v)
            return attend(q, k, v, layer_id, batch, scale, sliding_window, kv_stored=True)
        store(layer_id, batch.out_cache_loc, k, v)
        out = attend(q, k, v, layer_id, batch, scale, sliding_window, kv_stored=True)
        set_kv(layer_id, batch.out_cache_loc, k, v)
        return out

    attn.forward = forward
    return engine


def top1_and_greedy(engine: Engine, prompts=PROMPTS) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
    """Per prompt: the top-1 after each prefix, the greedy continuation, the prompt logprobs."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, prompt_logprobs=1)
    outs = engine.generate(prompts, [params] * len(prompts))
    top1 = [[lp.top[0][0] for lp in o.prompt_logprobs[1:]] for o in outs]
    logprobs = [[lp.logprob for lp in o.prompt_logprobs[1:]] for o in outs]
    return top1, [o.output_ids for o in outs], logprobs


def agreement(unquantized: Engine, top1, greedy, base_top1, prompts=PROMPTS) -> float:
    """Share of positions where `unquantized` picks the same token: teacher-forced over the prompts,
    and over the greedy continuation (the unquantized top-1 after each prefix of prompt + output)."""
    params = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=1)
    rescored = unquantized.generate([p + g for p, g in zip(prompts, greedy)], [params] * len(prompts))
    same = total = 0
    for ours, theirs, out, prompt, g in zip(top1, base_top1, rescored, prompts, greedy):
        same += sum(a == b for a, b in zip(ours, theirs))
        picked = [lp.top[0][0] for lp in out.prompt_logprobs[len(prompt) - 1 :]]  # after prompt + g[:i]
        same += sum(a == b for a, b in zip(g, picked))
        total += len(ours) + len(g)
    return same / total


CASES = [
    ("llama", "torch_native", True),
    ("llama", "torch_native", False),
    ("gpt2", "torch_native", True),
    ("llama", "triton", True),
    ("gpt2", "triton", False),
]


@pytest.mark.parametrize("arch,backend,overlap", CASES)
def test_fp8_kv_agrees_like_a_plain_reference_quantization(arch, backend, overlap, tiny_models):
    path = tiny_models(arch)
    flags = dict(attention_backend=backend, disable_overlap_schedule=not overlap)
    prompts = prompts_for(backend)
    unquantized = engine_for(path)
    base_top1, _, base_logprobs = top1_and_greedy(unquantized, prompts)

    fp8 = engine_for(path, kv_cache_dtype="fp8_e4m3", **flags)
    pool = fp8.runner.kv_pool
    assert pool.quantized and all(b.dtype == FP8 for b in pool.k_storage + pool.v_storage)
    assert pool.scales_set and bool((pool.k_scales != 1).all()) and bool((pool.v_scales != 1).all())
    top1, greedy, logprobs = top1_and_greedy(fp8, prompts)
    # Quantization happened: the logprobs moved (FP8 silently skipped would give them exactly).
    assert max(abs(a - b) for x, y in zip(logprobs, base_logprobs) for a, b in zip(x, y)) > 1e-4

    ref = reference_engine(path, pool.k_scales.clone(), pool.v_scales.clone())
    ref_top1, ref_greedy, _ = top1_and_greedy(ref, prompts)
    ours = agreement(unquantized, top1, greedy, base_top1, prompts)
    theirs = agreement(unquantized, ref_top1, ref_greedy, base_top1, prompts)
    print(f"agreement {arch} {backend} overlap={overlap}: fp8 {ours:.3f}, reference {theirs:.3f}")
    assert ours >= theirs - 0.05, (ours, theirs)
    if backend == "torch_native":  # the same numbers as the reference, rounding for rounding
        assert ours == theirs


def test_the_pool_holds_twice_the_tokens_of_bf16_in_the_same_memory(tiny_models):
    path = tiny_models("llama")
    sized = dict(dtype="bfloat16", kv_cache_memory_gb=0.002, max_total_tokens=0)
    bf16 = engine_for(path, **sized).runner.kv_pool
    fp8 = engine_for(path, kv_cache_dtype="fp8_e4m3", **sized).runner.kv_pool
    assert bf16.dtype == torch.bfloat16 and fp8.dtype == FP8
    assert fp8.bytes_per_token() * 2 == bf16.bytes_per_token()
    assert fp8.capacity_tokens >= 1.9 * bf16.capacity_tokens


def with_loud_kv(src, dst, k_factor: float, v_factor: float) -> str:
    """The same model with K and V that many times larger (far past 448) and q and the output
    projection as many times smaller: the scores and the outputs do not change."""
    shutil.copytree(src, dst)
    tensors = load_file(f"{dst}/model.safetensors")
    factors = {"k_proj": k_factor, "v_proj": v_factor, "q_proj": 1 / k_factor, "o_proj": 1 / v_factor}
    for key in tensors:
        if key.endswith(".weight") and key.split(".")[-2] in factors:
            tensors[key] = tensors[key] * factors[key.split(".")[-2]]
    save_file(tensors, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_scales_are_applied_where_k_saturates_float8(backend, tiny_models, tmp_path):
    """K and V far above 448: with the calibrated scales the FP8 engine tracks the unquantized one;
    at scale 1.0 (scales ignored) they saturate and the output changes. K's and V's scales differ
    tenfold, so one read in place of the other shows too."""
    path = with_loud_kv(tiny_models("llama"), tmp_path / "loud", 3000.0, 300.0)
    prompts = prompts_for(backend)
    unquantized = engine_for(path)
    _, _, base_logprobs = top1_and_greedy(unquantized, prompts)
    pool = unquantized.runner.kv_pool
    assert min(float(b.abs().amax()) for b in pool.k_buffers + pool.v_buffers) > 448 * 4

    fp8 = engine_for(path, kv_cache_dtype="fp8_e4m3", attention_backend=backend)
    _, _, scaled = top1_and_greedy(fp8, prompts)
    scales = torch.cat([fp8.runner.kv_pool.k_scales, fp8.runner.kv_pool.v_scales])
    assert float(scales.min()) > 0.4  # amax / 448 * margin
    ignored = engine_for(path, kv_cache_dtype="fp8_e4m3", attention_backend=backend)
    ignored.runner.kv_pool.set_scales(torch.ones(2), torch.ones(2))
    _, _, unscaled = top1_and_greedy(ignored, prompts)

    def mean_error(logprobs):
        diffs = [abs(a - b) for x, y in zip(logprobs, base_logprobs) for a, b in zip(x, y)]
        return sum(diffs) / len(diffs)

    print(f"mean logprob error {backend}: scaled {mean_error(scaled):.4f}, unscaled {mean_error(unscaled):.4f}")
    assert mean_error(scaled) * 10 < mean_error(unscaled), (mean_error(scaled), mean_error(unscaled))


def write_kv_scales(src, dst, k_scales: list[float], v_scales: list[float], form: str) -> str:
    """`src` as an llm-compressor FP8 checkpoint (weights per channel) with a kv_cache_scheme and
    its per-layer K and V scale tensors, spelled as `form` says."""
    write_fp8_checkpoint(src, dst, "compressed-tensors channel")
    tensors = load_file(f"{dst}/model.safetensors")
    for n, (k, v) in enumerate(zip(k_scales, v_scales)):
        if form == "self_attn":
            names = (f"model.layers.{n}.self_attn.k_scale", f"model.layers.{n}.self_attn.v_scale")
        else:  # vLLM's other spelling
            names = tuple(f"model.layers.{n}.self_attn.{p}_proj.output_scale" for p in "kv")
        tensors[names[0]], tensors[names[1]] = torch.tensor(k), torch.tensor(v)
    save_file(tensors, f"{dst}/model.safetensors", metadata={"format": "pt"})
    with open(f"{dst}/config.json") as f:
        cfg = json.load(f)
    cfg["quantization_config"]["kv_cache_scheme"] = KV_SCHEME
    with open(f"{dst}/config.json", "w") as f:
        json.dump(cfg, f)
    return str(dst)


KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


@pytest.mark.parametrize("form", ["self_attn", "output_scale"])
def test_checkpoint_scales_are_read_not_calibrated(form, tiny_models, tmp_path):
    k_scales, v_scales = [0.0625, 0.125], [0.25, 0.5]
    path = write_kv_scales(tiny_models("llama"), tmp_path / "ckpt", k_scales, v_scales, form)
    engine = engine_for(path, kv_cache_dtype="fp8_e4m3")
    pool = engine.runner.kv_pool
    assert pool.k_scales.tolist() == k_scales and pool.v_scales.tolist() == v_scales
    out = engine.generate([PROMPTS[0]], [SamplingParams(max_new_tokens=4, temperature=0)])
    assert len(out[0].output_ids) == 4
    # The scales are no weights: the same checkpoint serves with an unquantized KV cache too.
    assert not engine_for(path).runner.kv_pool.quantized


def test_partial_checkpoint_scales_and_other_kv_schemes_are_refused(tiny_models, tmp_path):
    path = write_kv_scales(tiny_models("llama"), tmp_path / "partial", [0.1, 0.1], [0.1, 0.1], "self_attn")
    tensors = load_file(f"{path}/model.safetensors")
    del tensors["model.layers.1.self_attn.v_scale"]
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="v_scale of layer 1"):
        engine_for(path, kv_cache_dtype="fp8_e4m3")
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg["quantization_config"]["kv_cache_scheme"] = KV_SCHEME | {"dynamic": True}
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="kv_cache_scheme"):
        EngineConfig(model_path=path, device="cpu").resolve()


def test_flag_values_are_checked(tiny_models):
    path = tiny_models("llama")
    assert EngineConfig(model_path=path, device="cpu").resolve().kv_cache_dtype == "float32"
    assert EngineConfig(model_path=path, device="cpu", kv_cache_dtype="fp8_e4m3").resolve().kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="--kv-cache-dtype must be auto or fp8_e4m3"):
        EngineConfig(model_path=path, device="cpu", kv_cache_dtype="fp8_e5m2").resolve()


@pytest.mark.parametrize("overlap", [True, False])
def test_disaggregated_fp8_kv_moves_fp8_pages_and_matches_the_colocated_engine(tiny_models, overlap):
    path = tiny_models("llama")
    fp8 = dict(kv_cache_dtype="fp8_e4m3")
    prefill, decode = engines(path, overlap=overlap, prefill_kw=fp8, decode_kw=fp8)
    assert prefill.runner.kv_pool.quantized and decode.runner.kv_pool.quantized
    params = [SamplingParams(max_new_tokens=6, temperature=0)] * 3
    completions, results = drive(prefill, decode, PROMPTS[:3], params)
    chunk = prefill.config.chunked_prefill_size  # the prefill server's chunks: the same exact-within-chunk reads
    colocated = engine_for(path, page_size=8, chunked_prefill_size=chunk, **fp8).generate(PROMPTS[:3], params)
    assert [completions[f"r{i}"].output_ids for i in range(3)] == [o.output_ids for o in colocated]
    # One byte per K and V element: the pages that crossed are FP8.
    pool = decode.runner.kv_pool
    per_token = 2 * pool.num_layers * pool.kv_heads * pool.head_dim
    assert all(r.error is None and r.transfer_bytes % (8 * per_token) == 0 for r in results.values())
    assert sum(r.transfer_bytes for r in results.values()) == sum(-(-len(p) // 8) * 8 * per_token for p in PROMPTS[:3])


def test_mismatched_kv_dtypes_are_refused_with_the_flag_named(tiny_models):
    """The prefill server refuses the decode server's destination when it learns its layout."""
    path = tiny_models("llama")
    prefill, decode = engines(path, prefill_kw=dict(kv_cache_dtype="fp8_e4m3"), timeout=5.0)
    params = [SamplingParams(max_new_tokens=2, temperature=0)]
    with pytest.raises(ValueError, match=r"dtype float8_e4m3fn here vs float32 at the peer.*--kv-cache-dtype"):
        drive(prefill, decode, PROMPTS[:1], params, limit_s=60.0)


def test_the_host_tier_keeps_fp8_pages_byte_for_byte(tiny_models):
    """Pages evicted to host memory and copied back are the FP8 bytes: the answers are those of an
    FP8 engine whose pool never evicts. One request at a time, so both engines hit the same
    prefixes (a prompt's own tokens are read as computed and a hit's through float8: a request
    queued behind another that shares its prefix would hit where the roomy engine computes)."""
    path = tiny_models("llama")
    small = dict(max_total_tokens=32 * PAGE, context_length=256, page_size=PAGE, kv_cache_dtype="fp8_e4m3")
    host_gb = 64 * small_page_bytes(path, small) / (1 << 30)
    tiered = engine_for(path, host_kv_cache_gb=host_gb, **small)
    roomy = engine_for(path, **(small | dict(max_total_tokens=4096)))
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    prompts = conversations(12, seed=5)
    for turn in range(3):
        outputs = [tiered.generate([p], params)[0].output_ids for p in prompts]
        assert outputs == [roomy.generate([p], params)[0].output_ids for p in prompts]
        prompts = next_turns(prompts, outputs, seed=turn + 20)
    tree = tiered.scheduler.kv.tree_cache
    assert tree.host.dtype == FP8 and tree.stats["host_loaded_pages"] > 0


def small_page_bytes(path, flags) -> int:
    return engine_for(path, **flags).runner.kv_pool.bytes_per_token() * PAGE
