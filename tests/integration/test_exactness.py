"""Exactness of in-place recovery under a seeded, randomized fault matrix (CPU, gloo).

For every seed, `fault_matrix.schedule(seed)` injects HOFs (and page losses) into a leto-run
job of examples/gpt_inplace.py.  The oracle is the same script under **torchrun** with no
fault tolerance at all (plain mode: ordinary tensors, another page size and chunking): every
loss a rank logged -- including iterations that were redone after a recovery -- and the final
parameters and AdamW moments of every rank must be bit-identical to it, and the job must have
recovered in place (the shadows really took over: `promote` events, recovery report); with
`--demote release` every survivor must have demoted itself in process (`demoted` events).

Reproduce one schedule: `python tests/integration/fault_matrix.py SEED`.
Seeds: by default `fault_matrix.DEFAULT_SEEDS`, 13 of the 50 that together cover every fault
class of the full matrix (every category, both demotion modes, every injection point, 3 ranks,
a partially written chunk, latent and survivor page losses, a forged go key;
`test_the_default_seeds_cover_every_fault_class` holds them to it); about 2.5 min on 2 cores.
LETO_FULL_MATRIX=1 runs the full matrix, seeds 0-49 (about 10 min); LETO_EXACTNESS_SEEDS=N
[LETO_EXACTNESS_FIRST=F] runs N consecutive seeds from F instead.
"""
from __future__ import annotations

import os

import pytest

from fault_matrix import DEFAULT_SEEDS, FULL_SEEDS, STEPS, fault_classes, gpt_pages, schedule
from leto_testing import ROOT, base_env, final_digest, leto_cmd, run
from matrix_run import run_schedule

SCRIPT = str(ROOT / "examples" / "gpt_inplace.py")
if os.environ.get("LETO_EXACTNESS_SEEDS") or os.environ.get("LETO_EXACTNESS_FIRST"):
    FIRST = int(os.environ.get("LETO_EXACTNESS_FIRST", "0"))
    SEEDS = range(FIRST, FIRST + int(os.environ.get("LETO_EXACTNESS_SEEDS", "50")))
elif os.environ.get("LETO_FULL_MATRIX") == "1":
    SEEDS = FULL_SEEDS
else:
    SEEDS = DEFAULT_SEEDS
PAGES = gpt_pages()


@pytest.fixture
def references(gpt_reference):
    """The fault-free torchrun run of a world size (shared by the session: tests/conftest.py)."""
    return lambda world: gpt_reference(world, STEPS)


def test_the_default_seeds_cover_every_fault_class():
    """The default run's seeds exercise every class the full matrix does (no processes: the
    schedules are a pure function of the seed), and the classes are the ones the matrix is
    meant to hold -- so neither a change to the matrix nor to the subset can drop one."""
    full = set().union(*(fault_classes(schedule(s, PAGES)) for s in FULL_SEEDS))
    default = set().union(*(fault_classes(schedule(s, PAGES)) for s in DEFAULT_SEEDS))
    assert full - default == set(), f"classes only outside DEFAULT_SEEDS: {sorted(full - default)}"
    for must in ("forge", "latent loss:p1", "latent loss:p2", "latent loss:data",
                 "pages lost with the kill:survivor", "pages lost with the kill:killed rank",
                 "partially written chunk", "world:3", "at=recovery.localize", "at=rmu.commit",
                 "at=sync.after", "category:hang", "category:two-generations", "demote:release",
                 "demote:replace"):
        assert must in default, must


@pytest.mark.parametrize("seed", SEEDS)
def test_fault_schedule_is_bit_exact(seed, references, tmp_path):
    sch = schedule(seed, PAGES)
    run_schedule(sch, SCRIPT, ["--steps", str(STEPS), *sch.script_args()], STEPS,
                 references(sch.world), tmp_path)


def test_ablation_without_rmu_transactions_diverges(references, tmp_path):
    """Paper Fig. 12 end to end: the schedule of a passing seed, with RMU's transactions off
    (no undo copy, no chunk commits), gives a different model -- the exactness above comes from
    the transactions, not from luck."""
    sch = schedule(2, PAGES)                   # a kill inside the update of a chunk
    kill = "kill:rank=1:step=4:at=rmu.update:group=1:chunk=2:garbage=1"
    args = [a for a in sch.leto_args() if a != "--inject"]
    args = [a for a in args if not a.startswith(("kill:", "hang:", "pages:"))]
    p = run(leto_cmd(*args, "--inject", kill, SCRIPT, "--steps", str(STEPS), "--out",
                     str(tmp_path), "--no-transactions"), base_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    ref = references(2)
    assert final_digest(ref, 1) != final_digest(tmp_path, 1), "without transactions the interrupted update cannot be finished exactly"
