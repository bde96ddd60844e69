"""A script that brings its own torch optimizer, scheduler and model (examples/byo_train.py:
tied head, frozen sub-module, constant buffer, two parameter groups with their own lr and
weight decay, clipping), recovered in place under leto-run, against the same script under
torchrun with stock torch (plain mode's `job.optimizer` is `torch_opt.step()` and
`scheduler.step()`): bit for bit in every loss and every group's lr of every step a rank ran
(redone steps included), and in each rank's final `model.state_dict()` and `opt.state_dict()`.

The seeded fault matrix (tests/integration/fault_matrix.py, the one the tiny GPT runs) over
AdamW + LambdaLR, the model wrapped in DDP on odd seeds: `BYO_SEEDS` by default, 5 seeds (a
smallest cover of the matrix's 50) that hold every category of the matrix in which the
optimizer's values are restored differently (a HOF in compute, at the global synchronization,
inside an update, in successive generations, during a recovery), DDP and no DDP, 3 ranks under
DDP, a partially written chunk and both demotion modes
(`test_the_byo_seeds_cover_the_matrix_s_categories`; the mechanism's other classes -- hangs,
two ranks at once, page losses -- are the GPT matrix's, test_exactness.py); LETO_FULL_MATRIX=1
runs seeds 0-49.  Reproduce one: `python tests/integration/fault_matrix.py SEED --byo`.

Besides, Adam + CosineAnnealingLR and SGD-momentum + MultiStepLR on 2 ranks take two HOFs in
successive generations, chosen so that recovery goes through every way the optimizer's values
are restored: a step redone whose record was written (killed after it) and one whose record was
not (killed in backward: the previous step's record and one scheduler step), a step finished
from its record inside a chunk's update and right after the global synchronization -- at steps
where the scheduler changes lr; and AdamW on 2 ranks resumed from a torchrun checkpoint (a HOF
at the checkpointed job's first step: the checkpoint's values).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from fault_matrix import BYO_WIDTH, FULL_SEEDS, byo_args, byo_pages, fault_classes, schedule
from fault_matrix import STEPS as MATRIX_STEPS
from leto_testing import (ROOT, base_env, compare_runs, events, final_digest, leto_cmd, run,
                          shared_dir, torchrun_cmd)
from matrix_run import run_schedule

SCRIPT = str(ROOT / "examples" / "byo_train.py")
STEPS = 9
GEOMETRY = ("--page-bytes", "4096", "--data-pages", "4", "--tier1", "2", "--tier2", "1",
            "--chunk-pages", "2")
CASES = {      # name: (optimizer, world, injected HOFs)
    # MultiStepLR halves lr at steps 3 and 6 (its milestones are a Counter of int keys)
    "sgd": ("sgd", 2, ("kill:rank=0:step=3:at=sync.after",
                       "kill:rank=1:step=6:gen=1:at=rmu.commit:group=2:chunk=0")),
    # CosineAnnealingLR moves every step
    "adam": ("adam", 2, ("kill:rank=1:step=4:at=grads.protect",
                         "kill:rank=0:step=5:gen=1:at=rmu.undo:group=0:chunk=1")),
}
BYO_SEEDS = (0, 5, 7, 32, 41)
SEEDS = FULL_SEEDS if os.environ.get("LETO_FULL_MATRIX") == "1" else BYO_SEEDS
PAGES = byo_pages(BYO_WIDTH)


def _reference(tmp_path: Path, name: str, world: int, args: tuple) -> Path:
    d = tmp_path / name
    d.mkdir()
    p = run(torchrun_cmd("--standalone", "--nproc-per-node", str(world), SCRIPT, *args, "--out",
                         str(d)), base_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return d


@pytest.fixture(scope="module")
def byo_reference(tmp_path_factory):
    """`get(world, ddp)`: a fault-free torchrun run of the matrix's script (once per test
    run)."""
    def get(world: int, ddp: bool) -> Path:
        return shared_dir(tmp_path_factory, f"byo_ref_w{world}_{'ddp' if ddp else 'flat'}",
                          lambda d: _reference(d, "ref", world, tuple(byo_args(ddp)))) / "ref"
    return get


RESTORE_PATHS = ("compute", "sync", "rmu", "two-generations", "during-recovery")


def test_the_byo_seeds_cover_the_matrix_s_categories():
    """BYO_SEEDS hold every category whose recovery restores the optimizer's values another
    way, DDP at 3 ranks and without DDP, a partially written chunk and both demotion modes of
    the full matrix (pure functions of the seed: no processes)."""
    def classes(seed):
        sch = schedule(seed, PAGES)
        c = {x for x in fault_classes(sch) if x.startswith(("category:", "demote:", "partially"))}
        return c | {f"ddp:{seed % 2}", f"world:{sch.world}:ddp:{seed % 2}"}
    full = set().union(*(classes(s) for s in FULL_SEEDS if schedule(s, PAGES).forge is None))
    full = {c for c in full if not c.startswith("category:")
            or c.split(":")[1] in RESTORE_PATHS}
    got = set().union(*(classes(s) for s in BYO_SEEDS))
    assert all(schedule(s, PAGES).forge is None for s in BYO_SEEDS)
    assert full - got <= {"world:3:ddp:0"}, sorted(full - got)
    assert {"world:3:ddp:1", "partially written chunk", "ddp:0", "demote:release"} <= got


@pytest.mark.parametrize("seed", SEEDS)
def test_byo_fault_schedule_is_bit_exact(seed, byo_reference, tmp_path):
    sch = schedule(seed, PAGES)
    ddp = seed % 2 == 1
    run_schedule(sch, SCRIPT, [*byo_args(ddp), *sch.script_args()], MATRIX_STEPS,
                 byo_reference(sch.world, ddp), tmp_path)


def test_ddp_s_averaging_is_told_apart_at_three_ranks(byo_reference):
    """At 3 ranks DDP's bucketed average has other bits than the flat all-reduce, so a matrix
    run under DDP that matches torchrun + DDP used DDP's gradients."""
    assert final_digest(byo_reference(3, True), 0) != final_digest(byo_reference(3, False), 0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_own_optimizer_and_scheduler_recover_bit_exactly(case, tmp_path):
    kind, world, specs = CASES[case]
    args = ("--steps", str(STEPS), "--opt", kind)
    ref, out = _reference(tmp_path, "ref", world, args), tmp_path / "leto"
    out.mkdir()
    injects = [x for spec in specs for x in ("--inject", spec)]
    ev = tmp_path / "events.jsonl"
    p = run(leto_cmd("--standalone", "--nproc-per-node", str(world), "--no-status", *GEOMETRY,
                     "--hang-timeout", "60", *injects, "--events", str(ev), SCRIPT, *args,
                     "--out", str(out)), base_env(), timeout=300)
    why = f"{case}: {specs}\n{p.stderr[-4000:]}"
    assert p.returncode == 0, why
    compare_runs(ref, out, world, range(STEPS), why)
    promoted = {e["generation"] for e in events(ev) if e["event"] == "promote"}
    assert promoted == {1, 2}, f"both failures recovered in place; {why}"
    assert "Recovery report" in p.stderr
    # the waiting shadows rehearsed an update of this optimizer's kind (rmu/rehearsal.py)
    assert "update not rehearsed" not in p.stderr, why


def test_a_process_group_made_before_init_is_refused_in_place():
    """In place the group is init()'s (per generation, over the authenticated store): a script
    that makes its own first is stopped with the fix, and the agent points to the log."""
    p = run(leto_cmd("--standalone", "--nproc-per-node", "2", "--no-status",
                     str(ROOT / "tests" / "integration" / "scripts" / "own_pg_first.py")),
            base_env(), timeout=120)
    assert p.returncode == 1, p.stderr[-3000:]
    assert ("the script created the default process group before leto_runtime.init()" in p.stderr
            and "if not dist.is_initialized()" in p.stderr), p.stderr[-3000:]
    assert "or failed before it announced itself: see the trainer's log" in p.stderr


def test_a_torchrun_checkpoint_resumed_under_leto_run_recovers_bit_exactly(tmp_path):
    """torchrun saves `job.state_dict()` with DCP at step 4 and runs on (the reference);
    leto-run starts a new job from that checkpoint and takes a HOF in the backward of its first
    step (redone before any record of the killed rank: the checkpoint's values) and one inside
    an update: every
    step from 4 on and the final state equal the uninterrupted torchrun run, and the promoted
    trainer, which also loads the checkpoint, ignores it for the retained state."""
    ckpt = tmp_path / "ckpt"
    args = ("--steps", str(STEPS), "--opt", "adamw", "--ckpt", str(ckpt))
    ref = _reference(tmp_path, "ref", 2, (*args, "--save-at", "4"))
    out = tmp_path / "leto"
    out.mkdir()
    p = run(leto_cmd("--standalone", "--nproc-per-node", "2", "--no-status", *GEOMETRY,
                     "--inject", "kill:rank=0:step=4:at=backward",
                     "--inject", "kill:rank=1:step=6:gen=1:at=rmu.update:group=0:chunk=1:garbage=1",
                     SCRIPT, *args, "--resume", "--out", str(out)), base_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    compare_runs(ref, out, 2, range(4, STEPS), p.stderr[-4000:])
    assert "is not used: this trainer resumes from the retained state" in p.stderr
