"""What `--speculative draft` takes beside the target, known before the draft model is loaded
(common/engine/speculative/draft_memory.py), and the target's KV budget leaving it room (ModelRunner)."""

from types import SimpleNamespace

import pytest
import torch

from pdserve.common.config import EngineConfig
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.speculative.draft_memory import draft_reserve_bytes
from pdserve.common.kv_transfer.base import KVSide


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_reserve_is_what_the_draft_model_allocates_at_most(make_engine, tiny_models, arch):
    """Its weights (tied ones once), its KV pool with every row at full context, its request rows: the
    reserve bounds what the draft proposer allocated, within a page."""
    engine = make_engine(arch, speculative="draft", draft_model_path=tiny_models(arch), page_size=4)
    draft = engine.proposer.runner
    pool = draft.kv_pool
    allocated = (
        _bytes({id(p): p for p in draft.model.parameters()}.values())
        + _bytes([*pool.k_storage, *pool.v_storage])
        + _bytes([draft.req_to_token_pool.req_to_token])
    )
    reserve = draft_reserve_bytes(engine.config, draft.dtype)
    page = pool.page_size * 2 * pool.num_layers * pool.kv_heads * pool.head_dim * draft.dtype.itemsize
    assert allocated <= reserve <= allocated + page, (allocated, reserve)
    assert draft_reserve_bytes(EngineConfig(model_path=tiny_models(arch)), draft.dtype) == 0  # (no draft)


def test_the_target_leaves_the_draft_model_room(tiny_models, monkeypatch):
    """--mem-fraction-static's KV budget on a GPU: the fraction of the device, less what is in use and
    less the draft model's reserve; a budget it consumes is refused with the reserve named."""
    config = EngineConfig(
        model_path=tiny_models("llama"), speculative="draft", draft_model_path=tiny_models("llama"), page_size=4
    ).resolve()
    reserve = draft_reserve_bytes(config, torch.float32)
    assert reserve > 0
    total, free = 1 << 34, (1 << 34) - (1 << 30)  # 16 GiB, 1 GiB in use
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    runner = SimpleNamespace(config=config, device=torch.device("cpu"), dtype=torch.float32, kv_side=None)
    runner.config = config.__class__(**{**config.__dict__, "mem_fraction_static": 0.5})
    budget = ModelRunner._kv_budget_bytes(runner)
    assert budget == pytest.approx(total * 0.5 - (1 << 30) - reserve)
    assert runner.memory_report["draft"] == reserve
    runner.config = config.__class__(**{**config.__dict__, "mem_fraction_static": ((1 << 30) + reserve) / total})
    with pytest.raises(ValueError, match="kept for the draft model"):
        ModelRunner._kv_budget_bytes(runner)
    runner.kv_side = KVSide.SENDER  # a prefill server: it never speculates, nothing kept
    assert ModelRunner._kv_budget_bytes(runner) == pytest.approx(total * runner.config.mem_fraction_static - (1 << 30))
