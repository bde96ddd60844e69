"""No name is used that nothing defines, anywhere in the project's Python.

Much of the code runs only on a GPU machine (tests/gpu, the CUDA paths, benchmarks measured on
the lent H200), so a name lost in a refactoring there shows up only when that device time is
spent.  pyflakes reads every file without running it; only the errors that would raise at run
time count here (undefined names and locals, undefined `__all__` entries), not style."""
from __future__ import annotations

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


def test_the_check_sees_an_undefined_name(tmp_path: Path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    return READY_S\n")
    rep = _Collect()
    api.checkPath(str(bad), rep)
    assert rep.found and "READY_S" in rep.found[0]
