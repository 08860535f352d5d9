"""The transformers reference of `pdserve bench accuracy`: the same prompts through
`AutoModelForCausalLM`, one sequence at a time (no padding, whose masks change the numerics).

GSM8K: greedy `generate` with a fresh GenerationConfig (the checkpoint's generation_config.json
may carry sampling knobs the server does not apply) that stops on the ids the server stops on.
HellaSwag: one forward pass per (context, ending), log_softmax, the continuation's tokens summed.
"""

from __future__ import annotations

import os


def load_reference(model_path: str, device: str, dtype: str):
    """The checkpoint in transformers, in `dtype` on `device`: a directory, or a GGUF file (or a
    directory holding one) as the engine takes it (common/gguf_checkpoint.py).

    NOTE: a .gguf file needs GgufConfig(dequantize=True): without it transformers (5.x) keeps the
    weights in their GGUF blocks and runs its quantized matmul kernels wherever the `kernels`
    package has one for the device (it dequantizes, with a warning, only where none is found), so
    the reference would compute something other than the dense weights the engine serves."""
    from pdserve.common.gguf_checkpoint import gguf_file

    gguf = gguf_file(model_path)
    if gguf is None:
        from pdserve.bench.hf import load_hf_model

        return load_hf_model(model_path, device, dtype)
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder, name = os.path.split(os.path.abspath(gguf))
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        dtype=getattr(torch, dtype),
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )
    return model.to(device).eval()


def generate_greedy(
    model, prompts: list[list[int]], max_tokens: int, eos_ids: tuple[int, ...], device: str
) -> list[list[int]]:
    """The new tokens of greedy generation from each prompt (up to max_tokens, ending at an EOS)."""
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=list(eos_ids),
        pad_token_id=eos_ids[0] if eos_ids else 0,
    )
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            input_ids = torch.tensor([prompt], device=device)
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def continuation_logprobs(model, pairs: list[tuple[list[int], list[int]]], device: str) -> list[float]:
    """For each (context ids, continuation ids): the sum over the continuation's tokens of
    log_softmax of the logits one position before each (computed in float32)."""
    import torch

    sums = []
    with torch.inference_mode():
        for context, continuation in pairs:
            ids = context + continuation
            logits = model(torch.tensor([ids], device=device)).logits[0]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            positions = torch.arange(len(context), len(ids), device=device)
            targets = torch.tensor(continuation, device=device)
            sums.append(sum(logprobs[positions - 1, targets].tolist()))
    return sums
