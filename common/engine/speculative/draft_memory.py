"""What `--speculative draft` takes on the device beside the target, known before it is loaded: the target
sizes its KV cache from the memory it measures (--mem-fraction-static), and the draft model, loaded after
it, must fit in what that leaves (common/engine/model_runner.py subtracts this).

    rows  = draft_rows(config)                      # requests a verify step may have
    bytes = draft_reserve_bytes(config, dtype)      # weights + KV pool at its largest + request rows

The weights are counted on a meta-device copy of the draft model (its parameters' shapes and dtype: no
file is read but config.json); the pool at its largest, a row's pages at full context for every row
(DraftProposer takes no more: draft.py). Not counted: its CUDA graphs' memory and a forward's
activations (a few MiB for the small models drafts are).
"""

from __future__ import annotations

import torch

from pdserve.common.config import EngineConfig, read_hf_config
from pdserve.common.engine.models.loader import model_class
from pdserve.common.engine.tp import TPGroup
from pdserve.common.scheduling.pages import pages_for


def draft_rows(config: EngineConfig) -> int:
    """The draft pool's request rows: one per request a verify step may have (--speculative-max-batch,
    else --max-running-requests)."""
    rows = config.max_running_requests
    if config.speculative_max_batch > 0:
        rows = min(rows, config.speculative_max_batch)
    return rows


def draft_pool_pages(config: EngineConfig) -> int:
    """The draft pool's pages at most (page 0, reserved, not counted): every row at full context + k."""
    return draft_rows(config) * pages_for(config.context_length + config.num_speculative_tokens, config.page_size)


def draft_reserve_bytes(config: EngineConfig, dtype: torch.dtype) -> int:
    """Device bytes the draft model will hold in `dtype` (the target's): 0 unless --speculative draft."""
    if config.speculative != "draft":
        return 0
    cfg = read_hf_config(config.draft_model_path)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, TPGroup.single(torch.device("meta"))).to(dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # (tied weights once)
    num_layers, kv_heads, head_dim = model.kv_geometry()
    page_bytes = config.page_size * 2 * num_layers * kv_heads * head_dim * dtype.itemsize
    rows = draft_rows(config)
    row_bytes = (rows + 1) * config.context_length * 4  # ReqToTokenPool: int32 slots, a pad row
    return weights + (1 + draft_pool_pages(config)) * page_bytes + row_bytes
