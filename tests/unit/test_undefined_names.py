"""No name is used that nothing defines, anywhere in the project's Python.

Much of the code runs only on a GPU machine (tests/gpu, the CUDA paths, benchmarks measured on
the lent H200), so a name lost in a refactoring there shows up only when that device time is
spent.  pyflakes reads every file without running it; only the errors that would raise at run
time count here (undefined names and locals, undefined `__all__` entries), not style.  Python
programs held in module-level strings (a child process's code, run with `python -c`: the
benchmarks' and tests' CHILD, PROBE, ATTACK ...) are read too: a module-level string that
parses as Python and imports something is such a program."""
from __future__ import annotations

import ast
from pathlib import Path

from pyflakes import api, messages, reporter

from leto_testing import ROOT

FATAL = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)
TREES = ("leto_run", "leto_runtime", "benchmarks", "tests", "examples")


class _Collect(reporter.Reporter):
    def __init__(self) -> None:
        self.found: list[str] = []

    def flake(self, message) -> None:
        if isinstance(message, FATAL):
            self.found.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text) -> None:
        self.found.append(f"{filename}:{lineno}: syntax error: {msg}")

    def unexpectedError(self, filename, msg) -> None:
        self.found.append(f"{filename}: {msg}")


def test_every_name_used_is_defined():
    files = [p for t in TREES for p in sorted((ROOT / t).rglob("*.py"))]
    assert len(files) > 100, files[:5]
    rep = _Collect()
    for p in files:
        api.checkPath(str(p), rep)
    assert not rep.found, "\n".join(rep.found)


def _programs(path: Path) -> list[tuple[str, int, str]]:
    """(name, line, code) of each module-level string constant of `path` that is a Python
    program: it parses, spans lines and imports something."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str) and "\n" in node.value.value):
            continue
        code = node.value.value
        try:
            tree = ast.parse(code)
        except SyntaxError:
            continue                       # CUDA source, Markdown, a template: not Python
        if any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in tree.body):
            names = ",".join(t.id for t in node.targets if isinstance(t, ast.Name))
            out.append((names, node.lineno, code))
    return out


def test_every_name_used_in_a_child_program_is_defined():
    files = [p for t in TREES for p in sorted((ROOT / t).rglob("*.py"))]
    progs = [(p, *x) for p in files for x in _programs(p)]
    assert len(progs) >= 5, progs[:3]
    rep = _Collect()
    for p, names, line, code in progs:
        api.check(code, f"{p.relative_to(ROOT)}:{line} ({names})", rep)
    assert not rep.found, "\n".join(rep.found)


def test_the_check_sees_an_undefined_name(tmp_path: Path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    return READY_S\n")
    rep = _Collect()
    api.checkPath(str(bad), rep)
    assert rep.found and "READY_S" in rep.found[0]


def test_the_check_sees_an_undefined_name_in_a_child_program(tmp_path: Path):
    bad = tmp_path / "bench.py"
    bad.write_text('CHILD = r"""\nimport json\nprint(statistics.median([1]))\n"""\n')
    [(names, line, code)] = _programs(bad)
    rep = _Collect()
    api.check(code, f"{bad}:{line} ({names})", rep)
    assert names == "CHILD" and rep.found and "statistics" in rep.found[0]
