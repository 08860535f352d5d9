"""The start-up GEMM check of a server on an MPS SM share (common/engine/mps_check.py): a right GEMM
passes, a wrong or unrepeatable one is named, and the check runs only under a share below 100%."""

import itertools

import pytest
import torch
from torch import nn

from pdserve.common.engine import mps_check

SHAPES = [(64, 96), (128, 32)]


def test_a_right_gemm_passes():
    assert mps_check.gemm_failures(SHAPES, torch.bfloat16, "cpu", tokens=(8, 40)) == []
    assert mps_check.gemm_failures(SHAPES, torch.float32, "cpu", tokens=(8,)) == []


def test_wrong_rows_anywhere_and_unrepeatable_results_are_named():
    def one_wrong_row(x, w):  # deterministic, wrong in the last row only
        y = torch.nn.functional.linear(x, w)
        y[-1] = -y[-1]
        return y

    failures = mps_check.gemm_failures(SHAPES, torch.bfloat16, "cpu", one_wrong_row, tokens=(8, 40))
    assert len(failures) == 4 and all("off by" in f and "differ" not in f for f in failures)

    calls = itertools.count()

    def unrepeatable(x, w):  # right to rounding, but not the same bits twice
        y = torch.nn.functional.linear(x, w)
        return y + (next(calls) % 2) * 1e-3 * y.abs().max()

    failures = mps_check.gemm_failures(SHAPES[:1], torch.float32, "cpu", unrepeatable, tokens=(8,))
    assert len(failures) == 1 and "two runs differ" in failures[0]


def test_the_check_runs_only_for_a_gpu_share_below_100(monkeypatch):
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64), nn.Linear(64, 96))
    assert mps_check.linear_shapes(model) == [(64, 96), (96, 64)]
    monkeypatch.setattr(mps_check, "gemm_failures", lambda *a, **k: ["[64, 64] x [64, 96]: off by 100%"])
    cuda = torch.device("cuda")
    monkeypatch.delenv(mps_check.ENV, raising=False)
    mps_check.check_gemms_under_mps(model, torch.bfloat16, cuda)  # no MPS share: nothing checked
    monkeypatch.setenv(mps_check.ENV, "100")
    mps_check.check_gemms_under_mps(model, torch.bfloat16, cuda)
    monkeypatch.setenv(mps_check.ENV, "70")
    mps_check.check_gemms_under_mps(model, torch.bfloat16, torch.device("cpu"))  # not a GPU
    with pytest.raises(RuntimeError, match="SM share of 70%.*--sm-shares"):
        mps_check.check_gemms_under_mps(model, torch.bfloat16, cuda)
