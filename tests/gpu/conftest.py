"""GPU tests: run on the lent GPU (see docs/benchmarks/README.md for how); skipped without CUDA."""

import pytest
import torch


class _NeedsCuda(pytest.Module):
    def collect(self):
        pytest.skip("needs CUDA")  # (before the module is imported: some import CUDA-only kernels)


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path, parent):
    """Without CUDA each module here is skipped, also one named on the command line (a module-level
    skip in this conftest fails such a run: pytest loads this file first and reports the skip as an error)."""
    if not torch.cuda.is_available():
        return _NeedsCuda.from_parent(parent, path=module_path)
    return None


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    """fp32 parity needs real fp32 GEMMs, not TF32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
