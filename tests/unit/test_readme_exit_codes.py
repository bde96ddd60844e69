"""README's exit-code table lists exactly the exit codes `leto-run` can end with (the EXIT_*
constants of leto_run.errors, the only place codes live, and StoppedBySignal's 128+N)."""
from __future__ import annotations

from pathlib import Path

from leto_run import errors as E

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_codes() -> list[str]:
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "### Exit codes")
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append(line.strip().strip("|").split("|")[0].strip().strip("`"))
    assert rows[:2] == ["code", "---"], rows[:2]
    return rows[2:]


def test_readme_lists_exactly_the_exit_codes_of_the_code():
    code = sorted(str(v) for k, v in vars(E).items() if k.startswith("EXIT_")) + ["128+N"]
    assert E.StoppedBySignal(2).exit_code == 128 + 2
    assert readme_codes() == code          # each once, in order


def test_readme_table_says_what_the_error_classes_say():
    rows = {line.split("|")[1].strip(): line for line in README.read_text().splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()}
    assert "--max-restarts 0" in rows[str(E.EXIT_WORKER_FAILED)]
    assert "nothing was started" in rows[str(E.EXIT_USAGE)]
    assert "--max-restarts" in rows[str(E.EXIT_RESTARTS_EXHAUSTED)]
    assert "unrecoverable" in rows[str(E.EXIT_UNRECOVERABLE)]
    assert "job's key" in rows[str(E.EXIT_CONTROL_FORGED)]
