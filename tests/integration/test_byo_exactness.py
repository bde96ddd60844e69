"""A script that brings its own torch optimizer, scheduler and model (examples/byo_train.py:
tied head, frozen sub-module, constant buffer, two parameter groups with their own lr and
weight decay, clipping), recovered in place under leto-run, against the same script under
torchrun with stock torch (plain mode's `job.optimizer` is `torch_opt.step()` and
`scheduler.step()`): bit for bit in every loss and every group's lr of every step a rank ran
(redone steps included), and in each rank's final `model.state_dict()` and `opt.state_dict()`.

Each job takes two HOFs in successive generations, chosen so that recovery goes through every
way the optimizer's values are restored: a step redone whose record was written (killed after
it) and one whose record was not (killed in backward: the previous step's record and one
scheduler step; at a checkpointed job's first step: the checkpoint's values), a step finished
from its record inside a chunk's update (partly written chunk) and right after the global
synchronization -- at steps where the scheduler changes lr: SGD + MultiStepLR and Adam +
CosineAnnealingLR on 2 ranks, AdamW + LambdaLR with the model wrapped in DDP on 3 ranks, and
AdamW + LambdaLR on 2 ranks resumed from a torchrun checkpoint.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from leto_testing import ROOT, base_env, events, final_digest, leto_cmd, run, torchrun_cmd

SCRIPT = str(ROOT / "examples" / "byo_train.py")
STEPS = 9
GEOMETRY = ("--page-bytes", "4096", "--data-pages", "4", "--tier1", "2", "--tier2", "1",
            "--chunk-pages", "2")
CASES = {      # name: (optimizer, world, DDP, injected HOFs)
    # (AdamW + LambdaLR without DDP: the checkpoint test below)
    # MultiStepLR halves lr at steps 3 and 6 (its milestones are a Counter of int keys)
    "sgd": ("sgd", 2, False, ("kill:rank=0:step=3:at=sync.after",
                              "kill:rank=1:step=6:gen=1:at=rmu.commit:group=2:chunk=0")),
    # CosineAnnealingLR moves every step
    "adam": ("adam", 2, False, ("kill:rank=1:step=4:at=grads.protect",
                                "kill:rank=0:step=5:gen=1:at=rmu.undo:group=0:chunk=1")),
    # DDP averages the gradients (bucketed, in backward); at world 3 its bits differ from a
    # flat all-reduce's, so matching torchrun + DDP shows that DDP's were the ones used
    "adamw-ddp": ("adamw", 3, True, ("kill:rank=2:step=2:at=rmu.update:group=1:chunk=0:garbage=1",
                                     "kill:rank=0:step=4:gen=1:at=backward")),
}


def _steps(d: Path, rank: int) -> dict[int, set[tuple]]:
    out: dict[int, set[tuple]] = {}
    for line in (d / f"loss_{rank}.jsonl").read_text().splitlines():
        e = json.loads(line)
        out.setdefault(e["step"], set()).add((e["loss"], tuple(e["lrs"])))
    return out


def _reference(tmp_path: Path, name: str, world: int, args: tuple) -> Path:
    d = tmp_path / name
    d.mkdir()
    p = run(torchrun_cmd("--standalone", "--nproc-per-node", str(world), SCRIPT, *args, "--out",
                         str(d)), base_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return d


@pytest.mark.parametrize("case", sorted(CASES))
def test_own_optimizer_and_scheduler_recover_bit_exactly(case, tmp_path):
    kind, world, ddp, specs = CASES[case]
    args = ("--steps", str(STEPS), "--opt", kind) + (("--ddp",) if ddp else ())
    ref, out = _reference(tmp_path, "ref", world, args), tmp_path / "leto"
    out.mkdir()
    injects = [x for spec in specs for x in ("--inject", spec)]
    ev = tmp_path / "events.jsonl"
    p = run(leto_cmd("--standalone", "--nproc-per-node", str(world), "--no-status", *GEOMETRY,
                     "--hang-timeout", "60", *injects, "--events", str(ev), SCRIPT, *args,
                     "--out", str(out)), base_env(), timeout=300)
    why = f"{case}: {specs}\n{p.stderr[-4000:]}"
    assert p.returncode == 0, why
    for rank in range(world):
        want, got = _steps(ref, rank), _steps(out, rank)
        assert sorted(got) == list(range(STEPS)), f"rank {rank} missed steps; {why}"
        for step, values in got.items():
            assert values == want[step], f"rank {rank} step {step}: {values} != {want[step]}; {why}"
        assert final_digest(ref, rank) == final_digest(out, rank), \
            f"rank {rank}: final model/optimizer state differs; {why}"
    promoted = {e["generation"] for e in events(ev) if e["event"] == "promote"}
    assert promoted == {1, 2}, f"both failures recovered in place; {why}"
    assert "Recovery report" in p.stderr
    if ddp:
        flat = _reference(tmp_path, "flat", world, args[:-1])
        assert final_digest(flat, 0) != final_digest(ref, 0), "DDP's averaging is not told apart"


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
    for rank in range(2):
        want, got = _steps(ref, rank), _steps(out, rank)
        assert sorted(got) == list(range(4, STEPS)), p.stderr[-3000:]
        for step, values in got.items():
            assert values == want[step], f"rank {rank} step {step}"
        assert final_digest(ref, rank) == final_digest(out, rank), f"rank {rank}"
    assert "is not used: this trainer resumes from the retained state" in p.stderr
