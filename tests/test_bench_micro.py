"""bench/ and bench/micro/: `pdserve bench --help` lists the benchmarks of a deployment, names the
micro-benchmarks after them (which still run under their old sub-command names), and the two
folders' split holds (bench/micro/__init__.py lists every micro module; bench/ never needs one)."""

import re
from pathlib import Path

from pdserve.bench.micro.cli import MODULES
from pdserve.common.cli import build_parser

BENCH = Path(__file__).resolve().parents[1] / "bench"
MICRO_COMMANDS = ("spec-replay", "spec-itl", "spec-overlap", "transfer")


def _bench_help() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["bench"].format_help()


def test_help_lists_the_deployment_benchmarks_and_names_the_micro_ones_after():
    text = _bench_help()
    listed, epilog = text.split("micro-benchmarks (developer tools, bench/micro/)")
    for command in ("offline", "serve", "accuracy"):
        assert re.search(rf"^    {command} ", listed, re.M), command
    for command in MICRO_COMMANDS:
        assert command not in listed.split("positional arguments:")[1]
        assert re.search(rf"^  {command} +\S", epilog, re.M), command
    for name in MODULES.split():
        assert name in epilog
    assert "pdserve.bench.soak|migration|startup" in listed


def test_the_micro_sub_commands_still_run_under_their_names():
    parser = build_parser()
    assert parser.parse_args(["bench", "transfer", "--requests", "2"]).func.__module__ == "pdserve.bench.micro.cli"
    for command in ("spec-replay", "spec-itl", "spec-overlap"):
        args = parser.parse_args(["bench", command, "--model-path", "x"])
        assert args.func.__module__ == f"pdserve.bench.micro.{command.replace('-', '_')}"


def test_every_micro_module_is_listed_and_every_runnable_one_named_in_the_help():
    listing = (BENCH / "micro" / "__init__.py").read_text()
    runnable = set()
    for path in sorted((BENCH / "micro").glob("*.py")):
        if path.stem in ("__init__", "cli"):
            continue
        assert path.stem in listing, f"{path.name} is missing from bench/micro/__init__.py"
        if 'if __name__ == "__main__"' in path.read_text():
            runnable.add(path.stem)
    assert runnable == set(MODULES.split())


def test_the_deployment_benchmarks_need_no_micro_module():
    for path in BENCH.glob("*.py"):
        if path.name != "cli.py":  # it registers the micro sub-commands (bench/micro/cli.py)
            assert not re.search(r"^\s*(from|import) pdserve\.bench\.micro", path.read_text(), re.M), path.name


def test_dropped_kernels_launch_nothing_and_leave_the_rest(monkeypatch):
    """decode_step --drop-kernels (bench/micro/drop_kernels.py): the named kernels are replaced, the
    GEMMs are not; an FP8 input made so is the right shape, unwritten."""
    import torch

    from pdserve.bench.micro import drop_kernels
    from pdserve.common.engine.attention import triton_backend
    from pdserve.common.engine.models import fp8_kernels

    for module, name in [(fp8_kernels, n) for n in ("rmsnorm_fp8", "quantize_per_token", "_quantize_rows_by_amax",
                                                    "_sum_partials", "fp8_gemm")] + [
        (triton_backend, "rope_store_kv"), (triton_backend, "decode_attention")]:  # fmt: skip
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    gemm, attention = fp8_kernels.fp8_gemm, triton_backend.decode_attention
    rope, norm = triton_backend.rope_store_kv, fp8_kernels.rmsnorm_fp8
    drop_kernels.drop(["norms"])
    assert fp8_kernels.rmsnorm_fp8 is not norm and triton_backend.rope_store_kv is rope  # only the one named
    drop_kernels.drop(["small"])
    q, scale = fp8_kernels.rmsnorm_fp8(torch.zeros(3, 64), torch.ones(64), 1e-5, None, 1e-4)
    assert q.shape == (3, 64) and q.dtype == torch.float8_e4m3fn and scale.shape == (3, 1)
    assert fp8_kernels._sum_partials[(3, 1)](1, 2, 3) is None and triton_backend.rope_store_kv(1, 2) is None
    assert fp8_kernels.fp8_gemm is gemm and triton_backend.decode_attention is attention
    drop_kernels.drop(["attention"])
    assert triton_backend.decode_attention is not attention
