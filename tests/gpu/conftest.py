"""GPU tests: run on the lent GPU (see docs/benchmarks.md for how); skipped without CUDA."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    """fp32 parity needs real fp32 GEMMs, not TF32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
