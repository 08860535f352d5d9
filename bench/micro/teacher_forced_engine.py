"""Teacher-forced top-1 agreement of the engine itself (no servers) with transformers, per FP8 configuration.

    python -m pdserve.bench.micro.teacher_forced_engine --model-path SmolLM2-135M-Instruct.Q4_1.gguf --device cuda

`pdserve bench accuracy --tasks teacher_forced` measures the served path; this runs the same plan,
reference and score (bench/teacher_forced.py) around `Engine.generate` with `prompt_logprobs=1` (the
numbers the prefill server returns), every configuration in one process: the GPU call that carries a
real checkpoint then needs no servers. The reference is transformers in fp32 on the same file.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

CONFIGS = {  # name -> engine flags (chunks of 32: each position reads all but its own chunk from the pool)
    "plain": {},
    "plain-chunk32": {"chunked_prefill_size": 32},
    "fp8kv": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8kv-chunk32": {"kv_cache_dtype": "fp8_e4m3", "chunked_prefill_size": 32},
    "fp8w": {"quantization": "fp8"},
    "fp8w-fp8kv": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"},
    "fp8w-block": {"quantization": "fp8-block"},
    "fp8-head": {"fp8_lm_head": True},
    "fp8w-fp8-head": {"quantization": "fp8", "fp8_lm_head": True},
}


def main(argv: list[str] | None = None) -> int:
    import torch

    from pdserve.bench import teacher_forced
    from pdserve.bench.accuracy import load_items
    from pdserve.bench.accuracy_hf import load_reference
    from pdserve.common.engine.engine import Engine
    from pdserve.common.types import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--limit", type=int, default=100, help="The first N texts (of 100).")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="Comma-separated, of: " + ", ".join(CONFIGS))
    parser.add_argument("--output-json", default="")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    if unknown := [n for n in names if n not in CONFIGS]:
        parser.error(f"unknown configurations {unknown}; known: {list(CONFIGS)}")

    reference_model = load_reference(args.model_path, args.device, "float32")
    plan = reference = None
    results = {}
    for name in names:
        start = time.time()
        engine = Engine(model_path=args.model_path, device=args.device, dtype=args.dtype, **CONFIGS[name])
        if plan is None:
            plan = teacher_forced.plan(load_items("teacher_forced", args.limit), engine.tokenizer)
            reference = teacher_forced.reference(reference_model, plan, args.device)
            del reference_model
        params = SamplingParams(max_new_tokens=0, prompt_logprobs=1, temperature=0)
        served = []
        for c in engine.generate(plan.prompt_ids, params):
            scored = c.prompt_logprobs[1:]  # (position 0 has no logprob)
            served.append({"top1": [lp.top[0][0] for lp in scored], "logprobs": [lp.logprob for lp in scored]})
        summary = teacher_forced.score(plan, served, reference)
        results[name] = {k: summary[k] for k in ("agreement", "positions", "max_abs_logprob_diff")}
        print(
            f"{name:14s} top-1 agreement {summary['agreement']:.2%} over {summary['positions']} positions, "
            f"max |d logprob| {summary['max_abs_logprob_diff']:.2f} ({time.time() - start:.0f} s)",
            flush=True,
        )
        del engine
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model_path": args.model_path, "device": args.device, "dtype": args.dtype,
                       "results": results}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
