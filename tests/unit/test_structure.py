"""The module structure holds what docs/ARCHITECTURE.md says of it (checked from the source,
nothing imported): the runtime's modules import each other without a cycle, counting imports
inside functions too (a function-level cycle is still a cycle: it only moves the failure to the
first call), and the one runtime object is where the process's singletons live."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "leto_runtime"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in it (module or function level)."""
    me = _module_name(path)
    pkg = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in modules:
                n = n.rpartition(".")[0]
            if n and n != me and not me.startswith(n + "."):   # a package's own __init__ aside
                out.add(n)
    return out


def _graph() -> dict[str, set[str]]:
    files = [p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts]
    modules = {_module_name(p) for p in files}
    return {_module_name(p): _imports(p, modules) for p in files}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_among_runtime_modules():
    graph = _graph()
    assert "leto_runtime.job" in graph and graph["leto_runtime.job"], "the scan found no imports"
    assert _cycles(graph) == []


def test_the_runtime_object_imports_nothing_of_the_runtime():
    """It is below everything that keeps state in it: beats, job, demotion."""
    graph = _graph()
    assert graph["leto_runtime.runtime"] == set()
    for owner in ("leto_runtime.beats", "leto_runtime.job", "leto_runtime.demotion"):
        assert "leto_runtime.runtime" in graph[owner], owner


def test_one_geometry_for_every_side():
    """The agent's config, the state manager and the trainer use one `Geometry` class, defined
    once; and the trainer takes its device pages from the state manager's hello."""
    from leto_run.config import RecoveryConfig
    from leto_run.state_manager.metadata import Geometry as OfStateManager
    from leto_runtime.rmu.states import Geometry as OfTrainer
    from leto_runtime.wire.geometry import Geometry, of_pool
    assert OfStateManager is Geometry and OfTrainer is Geometry
    assert type(RecoveryConfig().geometry) is Geometry and RecoveryConfig().geometry == Geometry()
    defined = [p for p in (ROOT / "leto_run").rglob("*.py")] + list(PKG.rglob("*.py"))
    classes = [str(p.relative_to(ROOT)) for p in defined if "class Geometry" in p.read_text()]
    assert classes == ["leto_runtime/wire/geometry.py"]
    hello = {"geometry": Geometry(32, 16, 1, 4096).to_json(), "device_page_bytes": 2 << 20}
    assert of_pool(hello) == Geometry(32, 16, 1, 2 << 20)


def test_the_state_manager_imports_only_the_wire_package():
    """`leto_run/state_manager/` reads what it shares with the trainer from `leto_runtime.wire`
    and never imports the trainer's client modules (function-level imports included)."""
    bad = []
    for path in sorted((ROOT / "leto_run" / "state_manager").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.name}: {n}" for n in names
                    if n.split(".")[0] == "leto_runtime" and not n.startswith("leto_runtime.wire")]
    assert not bad, bad


def test_the_policies_and_the_group_never_see_the_agent():
    """Only the launcher's entry imports the agent; the group, the supervisor and the policies
    work over the group (docs/ARCHITECTURE.md, "The control loop")."""
    importers = []
    for path in sorted((ROOT / "leto_run").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if "leto_run.agent" in names:
                importers.append(path.relative_to(ROOT).as_posix())
    assert importers == ["leto_run/cli.py"], importers
    for name in ("group", "supervisor", "inplace", "restart"):     # no back-pointer either
        tree = ast.parse((ROOT / "leto_run" / f"{name}.py").read_text())
        refs = [n for n in ast.walk(tree) if isinstance(n, (ast.Name, ast.Attribute, ast.arg))]
        assert not [n for n in refs if getattr(n, "id", None) == "agent"
                    or getattr(n, "attr", None) == "agent"
                    or getattr(n, "arg", None) == "agent"], name


def test_no_module_over_500_lines_and_no_function_over_80():
    """The size rule of the code base (docs/ARCHITECTURE.md, "Folders and the processes they
    run in"), for the launcher, the runtime and the benchmarks."""
    big, long_fns = [], []
    for folder in ("leto_run", "leto_runtime", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            rel = path.relative_to(ROOT).as_posix()
            if len(text.splitlines()) > 500:
                big.append(rel)
            long_fns += [f"{rel}:{n.name}" for n in ast.walk(ast.parse(text))
                         if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and n.end_lineno - n.lineno + 1 > 80]
    assert not big and not long_fns, (big, long_fns)
