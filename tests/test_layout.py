"""The tree is the architecture (docs/architecture.md, "Layout"): checks that keep it so.

- common/ never imports a role (prefill, decode, router) or the benchmarks: roles build on it.
- The event loops are the named functions in their roles, each short enough to read as the seeds'
  pseudocode, and the scheduler process runs the role's loop.
- No hand-written module grows past ~400 lines without saying why at its top.
"""

import ast
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("pdserve.prefill", "pdserve.decode", "pdserve.router", "pdserve.bench")
GENERATED = {"proto/pdserve_pb2.py", "proto/pdserve_pb2_grpc.py", "proto/pdserve_pb2.pyi"}
MAX_LINES = 400


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_common_never_imports_a_role():
    bad = []
    for path in sorted((ROOT / "common").rglob("*.py")):
        for name in imported_modules(path):
            if name.startswith(ROLES):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert bad == []


def test_the_event_loops_live_in_their_roles_and_are_short():
    from pdserve.common.engine import engine
    from pdserve.decode import loop as decode_loop
    from pdserve.prefill import loop as prefill_loop

    loops = [
        prefill_loop.event_loop_overlap_disagg_prefill,
        prefill_loop.event_loop_normal_disagg_prefill,
        decode_loop.event_loop_overlap_disagg_decode,
        decode_loop.event_loop_normal_disagg_decode,
        engine.event_loop_overlap,
        engine.event_loop_normal,
    ]
    for fn in loops:
        body = [
            line
            for line in inspect.getsource(fn).splitlines()[1:]
            if line.strip() and not line.strip().startswith(("#", '"""'))
        ]
        assert len(body) <= 25, f"{fn.__name__} has {len(body)} lines"
        assert "wait_stream" in inspect.getsource(fn) or "normal" in fn.__name__, f"{fn.__name__} has no WAR barrier"
    from pdserve.decode.engine import DecodeEngine
    from pdserve.prefill.engine import PrefillEngine

    assert "event_loop_overlap_disagg_decode" in inspect.getsource(DecodeEngine.event_loop)
    assert "event_loop_overlap_disagg_prefill" in inspect.getsource(PrefillEngine.event_loop)


def test_no_module_past_400_lines_without_a_reason_at_its_top():
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith((".venv", "tests/")) or rel in GENERATED or "/." in f"/{rel}":
            continue
        text = path.read_text()
        if text.count("\n") > MAX_LINES and "Why this file is long:" not in text[:3000]:
            long.append(f"{rel}: {text.count(chr(10))} lines")
    assert long == []
