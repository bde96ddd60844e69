"""Shadows at every preinitialization level (docs/PREINIT.md), moved by the agent during the run
(L3 -> L1 -> L2 -> L3, injected `preinit` changes: the agent relaunches the shadows at the level
and the active waits in that step until they are ready), with a HOF at each level: the promoted
shadows bring the levels they lack up on the critical path, and the run is bit-exact against the
same script under torchrun with stock torch (every loss and lr of every step, each rank's final
model and optimizer state).  examples/byo_train.py under DDP: a shadow below L3 waits inside
`leto_runtime.init()`, so the script's DDP is built over the group formed after its promotion.
The events say which level each promotion started from; the report says what each level cost.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from leto_testing import ROOT, base_env, compare_runs, events, leto_cmd, of, run, torchrun_cmd

SCRIPT = str(ROOT / "examples" / "byo_train.py")
STEPS = 12
ARGS = ("--steps", str(STEPS), "--opt", "adamw", "--ddp")
GEOMETRY = ("--page-bytes", "4096", "--data-pages", "4", "--tier1", "2", "--tier2", "1",
            "--chunk-pages", "2")
# generation: (the level its shadows are moved to before the HOF, the HOF)
SCHEDULE = (
    (0, None, "kill:rank=0:step=2"),
    (1, "preinit:rank=0:step=3:gen=1:level=L1", "kill:rank=1:step=5:gen=1:at=sync"),
    (2, "preinit:rank=0:step=6:gen=2:level=L2", "kill:rank=0:step=7:gen=2:at=rmu.update"),
    (3, "preinit:rank=1:step=8:gen=3:level=L3", "kill:rank=1:step=10:gen=3"),
)
PROMOTED_FROM = {1: "L3", 2: "L1", 3: "L2", 4: "L3"}


def _run(tmp_path: Path, demote: str) -> tuple[Path, str]:
    ref, out = tmp_path / "ref", tmp_path / "leto"
    ref.mkdir()
    out.mkdir()
    p = run(torchrun_cmd("--standalone", "--nproc-per-node", "2", SCRIPT, *ARGS, "--out",
                         str(ref)), base_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    injects = [x for _, lv, hof in SCHEDULE for spec in (lv, hof) if spec
               for x in ("--inject", spec)]
    ev = tmp_path / "events.jsonl"
    p = run(leto_cmd("--standalone", "--nproc-per-node", "2", "--no-status", *GEOMETRY,
                     "--hang-timeout", "120", "--demote", demote, *injects, "--events", str(ev),
                     SCRIPT, *ARGS, "--out", str(out)), base_env(), timeout=600)
    why = p.stderr[-6000:]
    assert p.returncode == 0, why
    compare_runs(ref, out, 2, range(STEPS), why)
    return ev, p.stderr


def _check_levels(ev: Path, stderr: str) -> None:
    evs = events(ev)
    for gen, level in PROMOTED_FROM.items():
        got = {e["level"] for e in of(evs, "promote", generation=gen)}
        assert got == {level}, f"generation {gen} promoted from {got}, not {level}"
        bringup = of(evs, "phase", generation=gen, phase="bringup")
        if level == "L3":
            assert not bringup, f"an L3 shadow brought nothing up: {bringup}"
            continue
        assert len(bringup) == 2 and {e["level"] for e in bringup} == {level}, bringup
        for e in bringup:
            assert e["l3_s"] > 0 and (e.get("l2_s", 0) > 0) == (level == "L1"), e
    moves = [(e["generation"], sorted(set(e["levels"].values()))) for e in of(evs, "preinit")]
    for gen, lv in ((2, ["L1"]), (3, ["L2"]), (4, ["L3"])):
        assert (gen, lv) in moves, f"no move of generation {gen}'s shadows to {lv}: {moves}"
    assert "from L1, L2 " in stderr and "from L2, L3 " in stderr, stderr[-3000:]


def test_shadows_at_every_level_recover_bit_exactly(tmp_path):
    _check_levels(*_run(tmp_path, "release"))


@pytest.mark.skipif(os.environ.get("LETO_FULL_MATRIX") != "1",
                    reason="the extended run (LETO_FULL_MATRIX=1): CI's 15 minutes")
def test_levels_with_survivors_replaced(tmp_path):
    """demote=replace: every next shadow is a fresh process at the controller's level (the
    release run above relaunches fresh shadows at each move too)."""
    _check_levels(*_run(tmp_path, "replace"))
