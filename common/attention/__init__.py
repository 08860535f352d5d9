"""Attention backends behind one interface (base.AttentionBackend)."""


def create_backend(name: str, req_to_token_pool, kv_pool):
    if name == "torch_native":
        from pdserve.common.attention.torch_native import TorchNativeBackend

        return TorchNativeBackend(req_to_token_pool, kv_pool)
    raise ValueError(f"unknown attention backend {name!r}; available: torch_native")
