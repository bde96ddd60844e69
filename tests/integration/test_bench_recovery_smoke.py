"""Smoke test of the recovery benchmark (benchmarks/recovery): the harness runs end to end with
real processes -- the fault-free reference with its checkpoint calibration, leto-run in place
and torchrun + DCP (async) under one SIGKILL each -- and writes every figure it promises.

No performance ratio is asserted (2 shared CPU cores, other tests beside it: the kill lands
1.5 s into a run sized with a 4.5 s tail, so a machine that is busier or freer during the run
than during the reference still meets it mid-run); what is asserted is that each recovery
happened the way its system recovers (a promotion with nothing recomputed for Leto, a rollback
to a checkpoint for torchrun) and was measured.  Two of the four faulted systems keep the test
around a minute; `--preset cpu-smoke` alone runs all four.  The metrics arithmetic is checked
on synthetic step records first (no processes)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from leto_testing import ROOT, base_env

if str(ROOT) not in sys.path:      # benchmarks/ is imported from the repository root
    sys.path.insert(0, str(ROOT))
from benchmarks.recovery import metrics as M  # noqa: E402

SYSTEMS = ("leto-inplace", "torchrun-dcp-async")


def _steps(rank, pid, steps, t0, dt, gen=0):
    return [{"ev": "step", "rank": rank, "pid": pid, "gen": gen, "step": s,
             "t0": t0 + k * dt, "t1": t0 + (k + 1) * dt, "ckpt": None}
            for k, s in enumerate(steps)]


def test_metrics_on_synthetic_records():
    # Two ranks, 1 s steps from t=0; killed at 10.4 (step 10 40% done).
    pre = _steps(0, 100, range(0, 11), 0.0, 1.0) + _steps(1, 101, range(0, 11), 0.0, 1.0)
    # Rollback: new processes resume at step 6 at t=20 (I = 9.6), step 10 done again at t=25.
    post = _steps(0, 200, range(6, 20), 20.0, 1.0) + _steps(1, 201, range(6, 20), 20.0, 1.0)
    f = M.failure(pre + post, 10.4, 1.0)
    assert f["interrupted_step"] == 10 and f["resumed_step"] == 6 and f["resume"] == "rollback"
    assert f["t_remain"] == pytest.approx(0.6) and f["I"] == pytest.approx(9.6)
    assert f["R"] == pytest.approx(25.0 - 20.0 - 0.6) and f["recomputed_steps"] == 4
    # In place, redo: the promoted trainers start step 10 again at 11.0.
    post = _steps(0, 300, range(10, 20), 11.0, 1.0) + _steps(1, 301, range(10, 20), 11.0, 1.0)
    f = M.failure(pre + post, 10.4, 1.0)
    assert f["resume"] == "redo" and f["I"] == pytest.approx(0.6)
    assert f["R"] == pytest.approx(0.4) and f["recovery"] == pytest.approx(1.0)
    # In place, finish: the update of step 10 was finished during recovery; step 11 next.
    post = _steps(0, 300, range(11, 20), 11.0, 1.0) + _steps(1, 301, range(11, 20), 11.0, 1.0)
    f = M.failure(pre + post, 10.4, 1.0)
    assert f["resume"] == "finish" and f["R"] == pytest.approx(-0.6)
    assert f["recomputed_steps"] == 0
    ref = _steps(0, 1, range(20), 0.0, 1.0)
    e = M.ettr(pre + post, ref)
    assert e["step"] == 19 and e["ettr"] == pytest.approx(20.0 / 20.0)
    assert M.young_interval(8.0, 100.0, 0.5) == 80        # sqrt(1600) / 0.5
    m = M.model_ettr(t_iter_ref=1.0, mttf_s=600.0, init_s=10.0, ckpt="sync", cost_s=3.0,
                     interval=60)
    assert m["T_eff"] == pytest.approx(1.05) and m["T_rec"] == pytest.approx(40.0)
    assert m["ettr"] == pytest.approx((1 / 1.05) * (1 - 40 / 600))


def test_first_step_phases_on_synthetic_records():
    """The first step of the new trainers by phase (the slowest rank's), beside the medians of
    the steady steps of the processes the fault interrupted (their first two steps left out)."""
    def ph(fwd, opt, allocs=0):
        return {"fwd": {"s": fwd, "cpu_s": fwd / 2, "allocs": allocs},
                "opt": {"s": opt, "cpu_s": 0.0, "allocs": 0}}
    pre = _steps(0, 100, range(0, 5), 0.0, 1.0) + _steps(1, 101, range(0, 5), 0.0, 1.0)
    for r in pre:     # steps 0 and 1 are cold (9 s forward); steady forwards 1, 2, 3, 4 s
        r["phases"] = ph(9.0 if r["step"] < 2 else float(r["step"] - 1), 0.5, allocs=r["step"])
    post = _steps(0, 200, range(5, 8), 7.0, 1.0) + _steps(1, 201, range(5, 8), 7.0, 1.0)
    for r in post:
        r["phases"] = ph(0.5, 0.25)
    post[3]["phases"] = ph(0.75, 2.0, allocs=7)            # rank 1's first step: the slowest
    post[3]["t1"] = post[3]["t0"] + 3.0
    f = M.failure(pre + post, 5.5, 1.0)
    got = M.first_step_phases(pre + post, f)
    assert got["step"] == 5 and got["rank"] == 1 and got["steady_steps"] == 6   # steps 2..4
    assert got["first"] == ph(0.75, 2.0, allocs=7)
    assert got["steady"]["fwd"] == {"s": 2.0, "cpu_s": 1.0, "allocs": 3}   # steps 2,3,4 x 2 ranks
    assert got["steady"]["opt"] == {"s": 0.5, "cpu_s": 0.0, "allocs": 0}
    for r in pre + post:
        r.pop("phases")
    assert M.first_step_phases(pre + post, f) is None


def _ours_left(marker: str) -> list[int]:
    left = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        left.append(int(d))
            except OSError:
                pass
    return left


def _harness(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "benchmarks.recovery", "--preset", "cpu-smoke", *args],
                          cwd=str(ROOT), env=base_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_recovery_harness_smoke(tmp_path):
    """Two calls, one run: the reference and Leto, then `--continue` adds torchrun + DCP (as
    the H200 run must, one device call holding only part of it)."""
    out, md, work = tmp_path / "rec.json", tmp_path / "rec.md", tmp_path / "work"
    proc = _harness("--systems", SYSTEMS[0], "--phases", "--work-dir", str(work), "--json",
                    str(out))
    assert proc.returncode == 0, f"harness failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    first = json.loads(out.read_text())
    assert set(first["systems"]) == {SYSTEMS[0]} and "continued" not in first
    proc = _harness("--systems", ",".join(SYSTEMS), "--phases", "--continue", str(out), "--work-dir",
                    str(work / "second"), "--json", str(out), "--md", str(md))
    assert proc.returncode == 0, f"harness failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert not _ours_left(str(work)), "processes of the benchmark outlived it"
    res = json.loads(out.read_text())
    assert len(res["continued"]) == 1 and res["date_utc"] == first["date_utc"]
    assert res["reference"] == first["reference"]          # measured once, in the first call
    assert res["systems"][SYSTEMS[0]] == first["systems"][SYSTEMS[0]]
    assert "reference: " not in proc.stderr and "measured in the run being continued" in proc.stderr

    ref = res["reference"]
    assert ref["ok"] and ref["steps"] > 5 and ref["T_ref"] > 0 and ref["t_iter"] > 0
    assert ref["calibration"]["sync_cost_s"] > 0 and ref["calibration"]["async_cost_s"] > 0
    assert res["intervals"]["sync"]["steps"] >= 1 and res["intervals"]["async"]["steps"] >= 1
    assert set(res["systems"]) == set(SYSTEMS)
    for name, r in res["systems"].items():
        assert r["complete"], name
        # no upper bound: beside other tests, the reference and a system run under other loads
        assert r["step"] == ref["steps"] - 1 and r["ettr"] > 0, (name, r["ettr"])
        [f] = r["failures"]
        assert f["I"] > 0 and f["recovery"] is not None and f["t_resume"] > f["t_fault"], f
        assert f["new_pids"] and f["pid"] not in f["new_pids"]
        assert r["timeline"] and r["extrapolated"]["ettr"] is not None
        assert r["model_run"]["ettr"] is not None

    leto = res["systems"]["leto-inplace"]
    [rec] = leto["leto_recoveries"]
    assert rec["kind"] == "InplaceRecovery" and rec["promote_s"] is not None, rec
    [f] = leto["failures"]
    assert f["resume"] in ("redo", "finish") and f["recomputed_steps"] == 0, f
    assert f["breakdown"]["detect_s"] is not None and 0 <= f["breakdown"]["detect_s"] < 1.0
    ph = f["first_step_phases"]          # --phases: the promoted trainer's first step by phase
    assert ph["step"] == f["resumed_step"] and set(ph["first"]) == {"fwd", "bwd", "opt"}, ph
    assert set(ph["steady"]) == {"fwd", "bwd", "opt"} and ph["steady_steps"] >= 1, ph
    assert all(x["s"] > 0 and x["cpu_s"] >= 0 for x in ph["first"].values()), ph

    tr = res["systems"]["torchrun-dcp-async"]
    [f] = tr["failures"]
    assert tr["interval"] == res["intervals"]["async"]["steps"]
    assert f["resume"] in ("rollback", "redo") and f["breakdown"]["load_s"] >= 0, f
    assert tr["launcher_env_extra"] == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    text = md.read_text()
    assert "| system | ckpt every (steps) |" in text and "Per failure" in text
    assert "First step after each recovery by phase" in text
    assert res["systems"]["torchrun-dcp-async"]["failures"][0]["first_step_phases"] is None
    assert "continued" in text
    assert {g["goal"] for g in res["goals"]} and all(isinstance(g["ok"], bool)
                                                    for g in res["goals"])

    # The figure is a separate step (matplotlib: a dev dependency, absent on the GPU machine).
    png = tmp_path / "rec.png"
    p = subprocess.run([sys.executable, "-m", "benchmarks.recovery.plot", str(out), "--png",
                        str(png)], cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert png.stat().st_size > 10_000


def test_continue_refuses_another_run_s_settings(tmp_path):
    """--continue on a run of other preset settings, or a file that is no run, exits 2 naming
    the difference, before anything is started."""
    out = tmp_path / "rec.json"
    out.write_text(json.dumps({"benchmark": "recovery", "preset": {"name": "cpu-smoke", "kills": 3},
                               "machine": {}, "reference": {}}))
    p = _harness("--continue", str(out), "--json", str(tmp_path / "x.json"), timeout=60)
    assert p.returncode == 2 and "other preset settings" in p.stderr and "kills" in p.stderr, p.stderr
    (tmp_path / "bad.json").write_text("{")
    p = _harness("--continue", str(tmp_path / "bad.json"), timeout=60)
    assert p.returncode == 2 and "cannot read it" in p.stderr, p.stderr
    assert not (tmp_path / "x.json").exists()
