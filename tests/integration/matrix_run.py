"""One seeded fault schedule (fault_matrix.Schedule) run under leto-run and judged against a
fault-free torchrun run of the same script: the runner of the exactness matrices
(test_exactness.py: the tiny GPT; test_byo_exactness.py: a script's own torch optimizer).

`run_schedule(sch, script, script_args, steps, ref, out)` starts the job (the script gets
`*script_args --out OUT`), forges a go key where the schedule says, and asserts: exit 0, every
logged step of every rank (redone ones included) equal to the reference bit for bit, the final
state digests equal, at least `sch.expect_inplace` in-place recoveries and no more than the
injected kills and hangs, every survivor asked to
demote in process did so, and the recovery report printed; a forged schedule instead stops
with exit 5 having logged only fault-free values.
"""
from __future__ import annotations

import datetime
import json
import subprocess
import time
from pathlib import Path

import torch.distributed as dist

from leto_testing import ROOT, base_env, compare_runs, events, leto_cmd, run, step_losses


def _forge_go_key(proc, ev: Path, rank: int) -> None:
    """As soon as the job's worker store exists, set the go key of generation 1 for `rank` as a
    process without the job's key would (an unsigned value): the shadow of generation 1 meets
    it at its first look, before any genuine promotion could overwrite it."""
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline and proc.poll() is None:
        rdzv = [e for e in (events(ev) if ev.exists() else []) if e["event"] == "rendezvous"]
        if rdzv:
            st = dist.TCPStore(rdzv[-1]["master_addr"], rdzv[-1]["master_port"],
                               is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=30))
            st.set(f"leto/go/1/{rank}", json.dumps({"mono": 0.0}))
            return
        time.sleep(0.05)


def _check_forged(sch, stderr: str, ref: Path, out: Path, evs: list[dict], why: str) -> None:
    assert "leto/go/" in stderr and "did not verify" in stderr, why
    granted = {(e["generation"], e["rank"]) for e in evs if e["event"] == "promote"}
    woke = {(e["generation"], e["rank"]) for e in evs if e["event"] == "promoted"}
    assert woke <= granted, f"a shadow woke without its agent's go key; {why}"
    for rank in range(sch.world):
        f = out / f"loss_{rank}.jsonl"
        got = step_losses(out, rank) if f.exists() else {}
        want = step_losses(ref, rank)
        for step, values in got.items():
            assert values == want[step], f"rank {rank} step {step}: {values}; {why}"


def _run_forged(sch, cmd: list[str], ev: Path):
    proc = subprocess.Popen(cmd, env=base_env(), cwd=str(ROOT), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _forge_go_key(proc, ev, sch.forge)
        _, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    return proc.returncode, err


def _check_demotions(sch, evs: list[dict], why: str) -> None:
    """Every survivor asked to demote itself did so in process, or died meanwhile (the schedule
    may kill it too): none had to be SIGKILLed for want of a confirmation.  (A rank blocked in
    an injected hang cannot demote itself: once a survivor page loss made another rank fail
    first, it is rightly replaced.)"""
    hung = {int(x.split(":rank=")[1].split(":")[0]) for x in sch.injects if x.startswith("hang:")}
    asked = [e for e in evs if e["event"] == "demote" and e.get("mode") == "release"
             and e["rank"] not in hung]
    died = [e for e in evs if e["event"] == "demote" and e.get("reason") == "exited"]
    fell_back = [e for e in evs if e["event"] == "demote" and e.get("reason")
                 and e.get("reason") != "exited" and e["rank"] not in hung]
    done = [e for e in evs if e["event"] == "demoted"]
    assert not fell_back and len(done) + len(died) == len(asked), \
        f"{fell_back} {asked} {done}; {why}"


def run_schedule(sch, script: str, script_args: list[str], steps: int, ref: Path,
                 out: Path) -> None:
    ev = out / "events.jsonl"
    cmd = leto_cmd(*sch.leto_args(), "--events", str(ev), "--log-dir", str(out / "logs"),
                   script, *script_args, "--out", str(out))
    if sch.forge is not None:
        returncode, stderr = _run_forged(sch, cmd, ev)
        why = (f"seed {sch.seed} (forged go key of rank {sch.forge}): {' '.join(sch.injects)}"
               f"\n{stderr[-4000:]}")
        print(f"seed {sch.seed}: forged go key -> exit {returncode}")
        if returncode == 5:       # a shadow met the forged value: stopped, nothing acted on it
            return _check_forged(sch, stderr, ref, out, events(ev), why)
        # else the genuine promotion overwrote it before any shadow looked (a shadow promoted
        # while still starting up): then the run must be exact like any other
    else:
        p = run(cmd, base_env(), timeout=300)
        returncode, stderr = p.returncode, p.stderr
        why = f"seed {sch.seed} ({sch.category}): {' '.join(sch.injects)}\n{stderr[-4000:]}"
    assert returncode == 0, why
    compare_runs(ref, out, sch.world, range(steps), why)
    evs = events(ev)
    promoted = {e["generation"] for e in evs if e["event"] == "promote"}
    assert len(promoted) >= sch.expect_inplace, f"no in-place recovery happened; {why}"
    # ... and no more recoveries than injected failures: a failure of the job itself that each
    # promoted trainer meets again would still end exact, one recovery per step later
    failures = sum(1 for x in sch.injects if x.startswith(("kill:", "hang:")))
    assert len(promoted) <= failures, f"{len(promoted)} recoveries for {failures} faults; {why}"
    if sch.demote == "release":
        _check_demotions(sch, evs, why)
    assert "Recovery report" in stderr
