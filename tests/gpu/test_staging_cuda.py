"""Checkpoint tensors to the GPU through pinned buffers (common/engine/models/staging.py): every byte
lands where `copy_` would put it, across buffer turns, and whatever is not a plain byte copy still
goes through `copy_`. The loader's use of it: tests/gpu/test_cuda_engine.py (greedy = transformers)."""

import torch

from pdserve.common.engine.models.staging import PinnedStaging


def test_tensors_land_exactly_across_many_buffer_turns():
    staging = PinnedStaging(torch.device("cuda"), chunk_bytes=1000)  # an odd size: chunks end mid-element
    sources = [
        torch.randn(37, 91).to(torch.bfloat16),
        torch.randn(5000),  # 20,000 bytes: 20 turns of the two buffers
        (torch.randn(64, 48) * 10).to(torch.float8_e4m3fn),
        torch.randint(-100, 100, (3,), dtype=torch.int64),
        torch.empty(0, 4),
    ]
    expected = [s.clone() for s in sources]
    targets = [torch.zeros(s.shape, device="cuda").to(s.dtype) for s in sources]
    for target, source in zip(targets, sources):
        staging.copy(target, source)
        source.fill_(3)  # the host's tensor may change once copy() returns: its bytes are staged
    staging.finish()
    for target, want in zip(targets, expected):
        assert torch.equal(target.cpu().view(torch.uint8), want.view(torch.uint8))


def test_what_is_no_plain_byte_copy_goes_through_copy_():
    staging = PinnedStaging(torch.device("cuda"), chunk_bytes=256)
    wide = torch.zeros(16, 32, device="cuda", dtype=torch.bfloat16)
    source = torch.randn(32, 16)
    staging.copy(wide, source.t())  # transposed source, and float32 into bfloat16
    staging.copy(wide[:, :8], torch.ones(16, 8, dtype=torch.bfloat16))  # a strided destination
    staging.finish()
    want = source.t().to(torch.bfloat16)
    want[:, :8] = 1
    assert torch.equal(wide.cpu(), want)
