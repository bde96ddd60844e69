"""RMU transactions on the GPU with real SIGKILLs: tests/integration/test_rmu_crash.py's worker
and kill points, on CUDA (2 MiB VMM pages owned by a real state manager).

On CUDA the updater queues its operations and its marker writes in stream order and never waits
between them (Marker.write_async), so here a kill without lost pages strikes while the GPU is
still behind the host: the CUDA context dies with queued kernels, copies and marker writes that
never run -- a crash at an arbitrary point of the device's progress, not at the host's.  Where
the recovery resumes then depends on how far the GPU got; what may not depend on it is the
result: model and optimizer state bit-identical to the fault-free run on the same device, and
every group's parity equal to its data."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from leto_run.state_manager import Geometry
from leto_run.state_manager.harness import SlotHarness

_spec = importlib.util.spec_from_file_location(
    "rmu_crash_cpu", Path(__file__).resolve().parents[1] / "integration" / "test_rmu_crash.py")
cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu)

GEO = Geometry(32, 16, 1, 2 << 20)
ENV = {"RMU_WORKER_DEVICE": "cuda"}


def run(sock, plan, *extra, allow=None, env=None):
    import os
    env = {**ENV, **(env or {})}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return cpu.run(sock, plan, *extra, allow=allow)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def reference():
    rc, res, err = run("-", [], "--local")
    assert rc == 0, err
    return res["digest"]


@pytest.mark.parametrize("case", [*cpu.CASES, *cpu.WB_CASES])
def test_kill_at_rmu_operation_is_bit_exact_on_cuda(case, reference):
    point, action = {**cpu.CASES, **cpu.WB_CASES}[case]
    with SlotHarness(device="cuda:0", geometry=GEO, allow_wait=10, ready_timeout=120) as h:
        rc, _, err = run(h.socket, [point], allow=h.allow)
        assert rc == -9, err
        rc, res, err = run(h.socket, [], allow=h.allow)
        assert rc == 0, err
    print(f"{case}: killed at {point['at']} of step {point['step']}; resumed {res['resume']}, "
          f"{res['repaired']} pages repaired")
    assert res["resume"][1] == point["step"], res
    assert res["digest"] == reference, f"{case}: state differs from the fault-free run"
    assert res["parity_problems"] == [] and res["parity_after_recovery"] == []
    if cpu.ROW16 in point.get("pages", []):
        assert res["repaired"] >= 16


# The default path (above) is the folded chunk (AdamW, the parity delta and the undo copy in one
# kernel, per-unit stage counts: rmu/fold.py), marker records stored by a kernel into registered
# host memory, and each group's write-back
# and tier 2 on the side stream beside the next group's chunks.  The alternatives stay
# selectable -- the two-kernel chunk and host-function markers it replaced, the in-line
# write-back (LETO_RMU_WB_OVERLAP=0), and two undo slots with the next chunk's copy beside the
# kernel (LETO_RMU_UNDO_PIPELINE=1) -- each with the kill points around what it changes.  Both
# runs of a case use the path.  H200, 2026-11-30 03:24 UTC, before the overlap became the
# default: CASES passed with it off, WB_CASES and the overlap's points with it on (all 11),
# pipelined undo + overlap 3 of 3 run (the call's time ran out).
ALTERNATIVES = {
    "twokernel": ({"LETO_RMU_FUSED_SYNDROME": "0"},
                  ["rmu.undo", "rmu.update+garbage", "rmu.delta+garbage", "rmu.commit", "update+pages@tolerance"]),
    "pipelined-undo": ({"LETO_RMU_UNDO_PIPELINE": "1"},
                       ["rmu.undo", "rmu.update+garbage", "rmu.delta+garbage", "update+pages@tolerance",
                        "rmu.load", "rmu.writeback", "slot 1 undo page lost",
                        "wb pending: Q rows + data of group 0"]),
    "inline-writeback": ({"LETO_RMU_WB_OVERLAP": "0"},
                         ["rmu.writeback", "rmu.tier2", "rmu.load", "writeback+pages@tolerance",
                          "update+done group pages@tolerance", "rmu.done"]),
    "hostfunc-marker": ({"LETO_RMU_STREAM_MARKER": "hostfunc"},
                        ["sync.after", "rmu.undo", "rmu.commit", "rmu.writeback", "commit+marker page lost"]),
    # the folded chunk (leto_runtime/rmu/fold.py): the undo copy inside the ws kernel
    "fold": ({"LETO_RMU_FOLD": "1"},
             ["rmu.undo", "rmu.update+garbage", "rmu.delta+garbage", "rmu.commit", "update+pages@tolerance",
              *cpu.FOLD_CASES]),
    # the same kernel counting every 4 stages (a fence per 4; LETO_RMU_FOLD_BATCH=4)
    "fold4": ({"LETO_RMU_FOLD": "1", "LETO_RMU_FOLD_BATCH": "4"},
              ["rmu.undo", "rmu.update+garbage", "rmu.commit", "update+pages@tolerance", *cpu.FOLD_CASES]),
}


# The paths on which the folded chunk runs: it is the default (LETO_RMU_FOLD=1), so the in-line
# write-back and the host-function markers run beside it; the two-kernel chunk and the pipelined
# undo slots have no folded kernel (their undo copy is a copy of its own).
FOLDED = {"fold", "fold4", "inline-writeback", "hostfunc-marker"}


@pytest.mark.parametrize("path,case", [(p, c) for p, (_, cases) in ALTERNATIVES.items() for c in cases])
def test_kill_on_an_alternative_path_is_bit_exact(path, case, reference):
    point, _ = {**cpu.CASES, **cpu.WB_CASES, **cpu.SLOT_CASES, **cpu.FOLD_CASES}[case]
    env = ALTERNATIVES[path][0]
    with SlotHarness(device="cuda:0", geometry=GEO, allow_wait=10, ready_timeout=120) as h:
        rc, _, err = run(h.socket, [point], allow=h.allow, env=env)
        assert rc == -9, err
        rc, res, err = run(h.socket, [], allow=h.allow, env=env)
        assert rc == 0, err
    print(f"{case} ({path}): resumed {res['resume']}, {res['repaired']} pages repaired")
    assert res["fold"] == (path in FOLDED), (
        "the folded chunk was not used (its kernel's check failed?)" if path in FOLDED else
        f"the folded chunk ran on the {path} path, which has none")
    assert res["digest"] == reference, f"{case}: state differs from the fault-free run"
    assert res["parity_problems"] == [] and res["parity_after_recovery"] == []
