"""Attention backends behind one interface (base.AttentionBackend).

Backends are imported when created: the Triton one defines kernels at import, and Triton reads
TRITON_INTERPRET at that moment (the CPU tests set it first).
"""


def create_backend(name: str, req_to_token_pool, kv_pool, num_heads: int, max_batch: int):
    if name == "torch_native":
        from pdserve.common.engine.attention.torch_native import TorchNativeBackend

        return TorchNativeBackend(req_to_token_pool, kv_pool)
    if name == "triton":
        from pdserve.common.engine.attention.triton_backend import TritonBackend

        return TritonBackend(req_to_token_pool, kv_pool, num_heads, max_batch)
    raise ValueError(f"unknown attention backend {name!r}; available: torch_native, triton")
