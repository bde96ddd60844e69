"""In-process demotion (`--demote release`), real processes and signals, gloo on CPU.

The survivor of a HOF releases its state and becomes the shadow of generation g+2 in the same
process (`leto_runtime.demotion`); at the next HOF that very process is promoted again.  The
oracle for the training itself is torchrun (plain mode), bit for bit; the oracle for "in
process" is the pid: the process promoted in generation 2 is the one spawned as rank 0's
active of generation 0.
"""
from __future__ import annotations

from fault_matrix import GEOMETRY, STEPS
from leto_testing import ROOT, base_env, compare_runs, events, leto_cmd, of, pid_alive, run

SCRIPT = str(ROOT / "examples" / "gpt_inplace.py")


def geometry_args() -> list[str]:
    g = GEOMETRY
    return ["--page-bytes", str(g["page_bytes"]), "--data-pages", str(g["data_pages"]),
            "--tier1", str(g["tier1"]), "--tier2", str(g["tier2"]),
            "--chunk-pages", str(g["chunk_pages"])]


def test_survivor_demotes_in_process_and_takes_over_at_the_next_hof(tmp_path, gpt_reference):
    ref = gpt_reference(2, STEPS)          # shared with the exactness tests (tests/conftest.py)
    out, ev = tmp_path / "leto", tmp_path / "ev.jsonl"
    out.mkdir()
    p = run(leto_cmd("--standalone", "--nproc-per-node", "2", *geometry_args(),
                     "--demote", "release", "--events", str(ev), "--log-dir", str(tmp_path / "l"),
                     # rank 1 dies in a backward: rank 0 is demoted (it waits in the all-reduce)
                     "--inject", "kill:rank=1:step=3:at=backward",
                     # then rank 1 again, inside an update: rank 0's demoted process takes over
                     "--inject", "kill:rank=1:step=8:gen=1:at=rmu.update:garbage=1",
                     SCRIPT, "--steps", str(STEPS), "--out", str(out)),
            base_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    evs = events(ev)
    first = of(evs, "spawn", role="active", generation=0, rank=0)[0]["pid"]
    [asked] = of(evs, "demote", generation=0, mode="release")
    [done] = of(evs, "demoted", generation=0)
    assert asked["rank"] == done["rank"] == 0 and done["pid"] == first
    assert done["agent_seconds"] < 5.0 and not of(evs, "demote", reason=None, mode="replace",
                                                  rank=0)
    # It let go of every view of retained memory the runtime made (none waits out the unmap's
    # timeout on the promotion's critical path).
    assert "views_alive" not in done, done["views_alive"]
    # The demoted process was not replaced: no fresh shadow of generation 2 for rank 0 ...
    assert not of(evs, "spawn", role="shadow", generation=2, rank=0)
    assert of(evs, "spawn", role="shadow", generation=2, rank=1)
    # ... it ran as that shadow and was promoted at the second HOF: the agent promoted it, and
    # the runtime in it woke up as generation 2's rank 0.  (Whether it reached L3 before the
    # second HOF depends on rank 1's fresh shadow, which forms the group with it.)
    promoted = {e["rank"]: e["pid"] for e in of(evs, "promote", generation=2)}
    assert promoted[0] == first
    assert [e["pid"] for e in of(evs, "promoted", generation=2, rank=0)] == [first]
    # Training is bit-exact against torchrun, redone steps included.
    compare_runs(ref, out, 2, range(STEPS), p.stderr[-3000:])
    assert "(release, in process)" in p.stderr
    assert not [e["pid"] for e in of(evs, "spawn") if pid_alive(e["pid"])]


def test_demote_option_rejects_unknown_modes():
    p = run(leto_cmd("--standalone", "--demote", "keep", SCRIPT), base_env(), timeout=60)
    assert p.returncode == 2
    assert "recovery.demote" in p.stderr and "release" in p.stderr
