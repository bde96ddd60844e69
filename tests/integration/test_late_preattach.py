"""A shadow that is ready before its active has made the retained states (a fast shadow beside
a large model's initialization: the fork server starts shadows in under a second) pre-attaches
them once they exist, while it waits, instead of attaching at its promotion (a second of the
first recovery of a 1B model, measured on the GPU).  Real processes and signals, gloo on CPU;
the training is compared with torchrun's bit for bit."""
from __future__ import annotations

import json

from fault_matrix import STEPS
from leto_testing import ROOT, base_env, compare_runs, events, leto_cmd, of, run
from test_demotion import geometry_args

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "late_states.py")


def test_a_shadow_ready_before_the_states_exist_pre_attaches_them_while_it_waits(
        tmp_path, gpt_reference):
    ref = gpt_reference(2, STEPS)          # shared with the exactness tests (tests/conftest.py)
    out, ev, late = tmp_path / "leto", tmp_path / "ev.jsonl", tmp_path / "late"
    out.mkdir()
    late.mkdir()
    p = run(leto_cmd("--standalone", "--nproc-per-node", "2", *geometry_args(),
                     "--events", str(ev), "--log-dir", str(tmp_path / "l"),
                     "--inject", "kill:rank=1:step=6:at=rmu.update:garbage=1",
                     SCRIPT, "--steps", str(STEPS), "--out", str(out)),
            base_env(LATE_DIR=str(late)), timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    # The order the test is about: both shadows of generation 1 made their optimizer first.
    assert sorted(x.name for x in late.iterdir()) == ["attached_0", "attached_1", "shadow_0",
                                                     "shadow_1"]
    evs = events(ev)
    attach = of(evs, "phase", phase="attach", generation=1)
    assert attach and all(e["preattached"] for e in attach), attach
    for rank in (0, 1):
        final = json.loads((out / f"final_{rank}.json").read_text())
        assert final["gen"] == 1 and final["recovery"].get("preattach_late_s"), final
        assert final["recovery"].get("rehearsal_s"), final     # rehearsed after the attach
        assert final["recovery"].get("warmup_s"), final        # the script's warm-up forward ran
    compare_runs(ref, out, 2, range(STEPS), p.stderr[-3000:])
