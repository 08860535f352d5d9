"""The tree is the architecture (docs/architecture.md, "Layout"): checks that keep it so.

- common/ never imports a role (prefill, decode, router) or the benchmarks: roles build on it.
- The event loops are the named functions in their roles, each short enough to read as the seeds'
  pseudocode, and the scheduler process runs the role's loop.
- No hand-written module grows past ~400 lines without saying why at its top.
- Imports run one way (no cycles), and scheduling sits below the engine, host-only.
"""

import ast
import inspect
import subprocess
import sys
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


PACKAGES = {"common": "pdserve.common", "prefill": "pdserve.prefill", "decode": "pdserve.decode",
            "router": "pdserve.router", "proto": "pdserve.proto", "bench": "pdserve.bench"}  # fmt: skip


def runtime_imports() -> dict[str, set[str]]:
    """Each of the project's modules -> the project modules it imports when it runs: at module level
    or inside a function, but not under `if TYPE_CHECKING:` (annotations only)."""
    modules = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body
            for n in ast.walk(stmt)
        }
        found = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_no_import_cycles():
    """The loop drives the engine or the engine runs the loop, not both: no module reaches itself
    through the project's imports (function-level imports count; TYPE_CHECKING ones do not)."""
    graph = runtime_imports()
    cycles = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            name, path = stack.pop()
            for nxt in sorted(graph[name]):
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert cycles == []


def test_scheduling_is_host_only_and_below_the_engine():
    """The scheduler decides, the runner writes device memory: common/scheduling imports neither
    the engine nor torch (so importing it loads no torch), and the engine may import scheduling."""
    graph = runtime_imports()
    up = [f"{m} imports {d}" for m, ds in graph.items() if m.startswith("pdserve.common.scheduling")
          for d in ds if d.startswith(("pdserve.common.engine", "pdserve.common.kv_transfer"))]  # fmt: skip
    assert up == []
    modules = sorted(m for m in graph if m.startswith("pdserve.common.scheduling."))
    code = f"import sys; import {', '.join(modules)}; print('torch' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "False"


def test_pdserve_help_loads_no_torch():
    """`pdserve --help` (every sub-command's parser, `up` and `bench` included) answers without torch."""
    code = (
        "import sys, contextlib, io\n"
        "from pdserve.common.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        "for sub in ('up', 'bench', 'make-tiny-model', 'run-batch'):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main([sub, '--help'])\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
