"""The Hugging Face transformers baseline: the same token ids through `AutoModelForCausalLM.generate`.

min_new_tokens = max_new_tokens = output_len keeps every row generating to the end (EOS is masked
until then), which is how transformers spells ignore_eos.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager


def load_hf_model(model_path: str, device: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the per-weight loading bar would bury the benchmark's lines
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype), local_files_only=True)
    return model.to(device).eval()


def free_hf_model(model) -> None:
    """Drop the model and hand its GPU memory back, so an engine built next can size its KV cache."""
    import torch

    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def cudnn_attention_off():
    """Keep torch's SDPA off cuDNN attention while transformers runs.

    NOTE: on Hopper SDPA picks cuDNN attention, which builds a plan for every new (batch, length)
    shape: ~25 ms per decode step until each shape has been seen once (H200, torch 2.11; the
    flash and memory-efficient kernels take ~4 ms per step either way for gpt2/small). Offline
    warm-up runs see every shape first; a serving load keeps meeting new batch sizes.
    """
    import torch

    previous = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(previous)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def generate_kwargs(model, output_len: int, temperature: float) -> dict:
    config = model.generation_config
    eos = config.eos_token_id
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    kwargs = {"max_new_tokens": output_len, "min_new_tokens": output_len, "pad_token_id": pad}
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False)
    return kwargs


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def check_generated(generated: list[list[int]], output_len: int, eos: set[int]) -> None:
    """Every row has exactly output_len real tokens. A row that stopped early would be padded out
    to the batch's length, so its length alone proves nothing: an EOS inside it gives it away."""
    for row, tokens in enumerate(generated):
        if len(tokens) != output_len:
            raise RuntimeError(f"transformers generated {len(tokens)} tokens for prompt {row}, expected {output_len}")
        if eos & set(tokens):
            raise RuntimeError(f"transformers stopped prompt {row} at an EOS before {output_len} tokens")


def hf_generate_timed(
    model, prompts: list[list[int]], output_len: int, batch_size: int, temperature: float, device: str
) -> float:
    """Generate every prompt (in batches of batch_size; 0: all at once); returns the elapsed seconds."""
    import torch

    kwargs = generate_kwargs(model, output_len, temperature)
    eos = eos_ids(model)
    batch_size = batch_size or len(prompts)
    batches = [torch.tensor(prompts[i : i + batch_size], device=device) for i in range(0, len(prompts), batch_size)]
    synchronize(device)
    start = time.perf_counter()
    outputs = []
    with torch.inference_mode():
        for input_ids in batches:
            outputs.append(model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs))
    synchronize(device)
    elapsed = time.perf_counter() - start
    for input_ids, out in zip(batches, outputs):
        check_generated(out[:, input_ids.shape[1] :].tolist(), output_len, eos)
    return elapsed
