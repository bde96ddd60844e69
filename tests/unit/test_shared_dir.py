"""`leto_testing.shared_dir`: a reference built once however many workers ask for it at once,
and built again after a build that failed (real processes racing on the lock)."""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from leto_testing import shared_dir


class _Factory:
    def __init__(self, base: Path) -> None:
        self.base = base

    def getbasetemp(self) -> Path:
        return self.base


def _ask(base: str, name: str, out) -> None:
    os.environ.pop("PYTEST_XDIST_WORKER", None)

    def build(d: Path) -> None:
        with open(Path(base) / "builds", "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)                       # the others arrive while it builds
        (d / "result").write_text("ok")
    d = shared_dir(_Factory(Path(base)), name, build)
    out.put((str(d), (d / "result").read_text()))


def test_one_build_for_every_worker_that_asks_at_once(tmp_path):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ask, args=(str(tmp_path), "ref", q)) for _ in range(3)]
    for p in procs:
        p.start()
    got = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len((tmp_path / "builds").read_text().split()) == 1
    assert {g for g in got} == {(str(tmp_path / "shared" / "ref"), "ok")}


def test_a_failed_build_is_done_again(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    f = _Factory(tmp_path)

    def broken(d: Path) -> None:
        (d / "partial").write_text("x")
        raise RuntimeError("reference run failed")
    with pytest.raises(RuntimeError):
        shared_dir(f, "ref", broken)
    d = shared_dir(f, "ref", lambda d: (d / "result").write_text("ok"))
    assert sorted(p.name for p in d.iterdir()) == [".complete", "result"]
