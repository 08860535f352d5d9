"""Regenerate the Python code for proto/pdserve.proto.

Run from anywhere, with pdserve installed (`pip install -e .`) and grpcio-tools in the same venv:

    python -m pdserve.proto.generate           # rewrite proto/pdserve_pb2{.py,.pyi,_grpc.py} if stale
    python -m pdserve.proto.generate --check   # change nothing; exit 1 with a diff summary if stale

The three generated files are committed. Use the grpcio-tools version named in the committed
pdserve_pb2_grpc.py (GRPC_GENERATED_VERSION): another version emits different bytes and `--check`
(and tests/test_proto.py) then fails, saying which version to install.

Import layout. protoc names a generated module after the .proto's path relative to its `-I` root,
and pdserve_pb2_grpc.py imports pdserve_pb2 by that name. The repository keeps the file at
proto/pdserve.proto while Python imports it as pdserve.proto (pyproject's package-dir), so protoc
run on it in place would write a top-level `import pdserve_pb2`, which fails inside the package.
Instead we copy the .proto into a temporary tree at pdserve/proto/pdserve.proto and run protoc with
`-I <tmp>`: the grpc module then says `from pdserve.proto import pdserve_pb2`, the descriptor is
registered as "pdserve/proto/pdserve.proto" under module pdserve.proto.pdserve_pb2, and no
generated line is edited afterwards. Output goes to a temporary directory and is copied over the
committed files only where the bytes differ, so running it twice changes nothing.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE / "pdserve.proto"
# Where the .proto sits inside protoc's include root: this is the import path of the package.
PROTO_REL = Path("pdserve") / "proto" / "pdserve.proto"
OUTPUTS = ("pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py")
_MAX_DIFF_LINES = 30  # per file
_MAX_LINE = 160  # pdserve_pb2.py's serialized descriptor is one very long line


def _clip(line: str) -> str:
    return line if len(line) <= _MAX_LINE else f"{line[:_MAX_LINE]}... ({len(line)} chars)"


def generate(proto: Path = PROTO) -> dict[str, bytes]:
    """Run protoc on `proto` (in a temporary tree); return {output file name: contents}.

    NOTE: protoc runs in a child process. grpc_tools' compiled protoc, imported into a process
    that already loaded torch (and nixl), can crash the interpreter (clashing native symbols).
    """
    import importlib.util

    spec = importlib.util.find_spec("grpc_tools")  # located without importing its native module
    if spec is None or spec.origin is None:
        raise RuntimeError("grpcio-tools is not installed: pip install grpcio-tools==1.85.1")
    with tempfile.TemporaryDirectory(prefix="pdserve-protoc-") as tmp:
        src, out = Path(tmp) / "src", Path(tmp) / "out"
        (src / PROTO_REL).parent.mkdir(parents=True)
        out.mkdir()
        shutil.copyfile(proto, src / PROTO_REL)
        well_known = Path(spec.origin).parent / "_proto"  # google/protobuf/*.proto, if imported
        args = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{src}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            PROTO_REL.as_posix(),
        ]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"protoc failed (exit {proc.returncode}) on {proto}: {proc.stderr.strip()}")
        gen_dir = out / PROTO_REL.parent
        return {name: (gen_dir / name).read_bytes() for name in OUTPUTS}


def stale(generated: dict[str, bytes], target: Path = HERE) -> list[str]:
    """Names of the generated files whose committed copy in `target` is missing or different."""
    return [
        name
        for name, data in generated.items()
        if not (target / name).is_file() or (target / name).read_bytes() != data
    ]


def diff_summary(generated: dict[str, bytes], target: Path = HERE) -> str:
    """A short human-readable account of how `target` differs from `generated`."""
    lines = []
    for name in stale(generated, target):
        path = target / name
        if not path.is_file():
            lines.append(f"{name}: missing")
            continue
        old = path.read_text(encoding="utf-8").splitlines(keepends=True)
        new = generated[name].decode("utf-8").splitlines(keepends=True)
        body = list(difflib.unified_diff(old, new, f"committed/{name}", f"generated/{name}", n=1))
        changed = sum(1 for line in body if line[:1] in "+-" and not line.startswith(("+++", "---")))
        lines.append(f"{name}: differs ({changed} lines changed)")
        lines.extend("    " + _clip(line.rstrip("\n")) for line in body[:_MAX_DIFF_LINES])
        if len(body) > _MAX_DIFF_LINES:
            lines.append(f"    ... {len(body) - _MAX_DIFF_LINES} more diff lines")
    hint = _version_hint(target)
    if lines and hint:
        lines.append(hint)
    return "\n".join(lines)


def _version_hint(target: Path) -> str:
    """Explain a difference caused by the installed grpcio-tools rather than the .proto."""
    try:
        from grpc_tools import grpc_version

        committed = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", (target / "pdserve_pb2_grpc.py").read_text())
    except (ImportError, OSError):
        return ""
    if committed and committed.group(1) != grpc_version.VERSION:
        return (
            f"note: the committed files were generated by grpcio-tools {committed.group(1)} but "
            f"{grpc_version.VERSION} is installed; install grpcio-tools=={committed.group(1)} "
            "unless you mean to move the project to a new version"
        )
    return ""


def write(generated: dict[str, bytes], target: Path = HERE) -> list[str]:
    """Copy the stale files into `target`; return their names (empty when all were current)."""
    changed = stale(generated, target)
    for name in changed:
        (target / name).write_bytes(generated[name])
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.proto.generate", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the committed files are stale")
    parser.add_argument("--proto", type=Path, default=PROTO, help="the .proto to compile (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=HERE, help="where the generated files live (default: %(default)s)")
    args = parser.parse_args(argv)

    generated = generate(args.proto)
    if args.check:
        summary = diff_summary(generated, args.out)
        if summary:
            print(f"generated code in {args.out} is out of date with {args.proto}:", file=sys.stderr)
            print(summary, file=sys.stderr)
            print("run: python -m pdserve.proto.generate", file=sys.stderr)
            return 1
        print(f"{', '.join(OUTPUTS)}: up to date")
        return 0
    changed = write(generated, args.out)
    print(f"wrote {', '.join(changed)}" if changed else f"{', '.join(OUTPUTS)}: already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
