"""Seeded, randomized fault schedules for the in-place exactness test (issue: in-place HOF
recovery, acceptance "fault matrix").  A pure function of the seed, so any failing schedule is
reproduced with

    python tests/integration/fault_matrix.py SEED [--byo]   # prints the leto-run command line

Each schedule is one `leto-run` job of `examples/gpt_inplace.py` (tiny GPT, gloo on CPU, 2 or 3
ranks, small pages so the model spans several protection groups) -- or, with the same rules
over its own page count, of `examples/byo_train.py` (`byo_args`; the script's own torch AdamW,
test_byo_exactness.py) -- with one or more injected
HOFs.  Categories rotate with the seed so that 50 consecutive seeds cover every cell of the
matrix several times: kills during forward/backward and the gradient all-reduce, during
gradient protection, at and right after the global synchronization, at every RMU operation
(with a partially written chunk and scratch parity where it applies), those combined with
page loss at the tolerance (16 device pages of the group being updated + 1 host tier-1 parity
page), two ranks in one iteration, a second HOF during the recovery, hangs, and HOFs in
successive generations.  Mixed into the schedules from a second seeded stream (so the
categories above are unchanged): latent losses -- a parity page (tier 1 or 2) or a few data
pages lost at an earlier step with no failure, which the trainer must repair at the next step
boundary before any use -- and page losses on a survivor (a rank other than the one killed),
striking at the same step and point as the kill; and on some seeds a forged go key (`forge`):
while the job runs, the test sets generation 1's go key of a rank without the job's key, as
another user could -- the shadow must not act on it and the job must stop (exit 5) with every
loss logged until then the fault-free one.  Survivors of a HOF are demoted in process (`--demote release`) on
seeds 10-19, 30-39, ... (every category, both world sizes) and replaced by fresh shadows on
the others (LETO_EXACTNESS_DEMOTE=replace|release forces one mode for every seed).

The full matrix is seeds 0-49 (`FULL_SEEDS`, about 10 min on 2 cores).  The default test run
takes `DEFAULT_SEEDS`, 13 of them chosen so that together they hold every fault class the 50
hold (`fault_classes`: every category, both demotion modes, every injection point of a kill or
a hang, both world sizes, a partially written chunk, latent losses of a tier-1 and a tier-2
parity page and of data pages, page losses on the killed rank and on a survivor, a forged go
key); what only the full matrix has is more combinations of them (e.g. each category under
both demotion modes, every point in both generations);
tests/integration/test_exactness.py checks that they still do, so a change to the matrix that
leaves a class out of the subset fails there.  LETO_FULL_MATRIX=1 runs all 50.
"""
from __future__ import annotations

import math
import os
import random
import sys
from dataclasses import dataclass, field

GEOMETRY = dict(page_bytes=4096, data_pages=32, tier1=16, tier2=1, chunk_pages=4)
STEPS = 14
COMPUTE_POINTS = ("step", "forward", "backward", "grads.allreduce")
SYNC_POINTS = ("grads.protect", "sync", "sync.after")
RMU_POINTS = ("rmu.load", "rmu.undo", "rmu.update", "rmu.delta", "rmu.commit",
              "rmu.writeback", "rmu.tier2", "rmu.done")
RECOVERY_POINTS = ("recovery.localize", "recovery.reconstruct", "recovery.finish")
CATEGORIES = ("compute", "sync", "rmu", "rmu+pages", "two-ranks", "during-recovery", "hang",
              "two-generations", "rmu+pages", "rmu")
FULL_SEEDS = range(50)
# A cover of fault_classes over FULL_SEEDS, cheapest runs first (forged seeds stop early;
# hangs and 3 ranks cost the most): see the module docstring.
DEFAULT_SEEDS = (1, 2, 3, 10, 12, 14, 15, 16, 17, 18, 20, 25, 47)


def model_pages(model) -> int:
    """Pages of one fp32 model state of `model` (on the meta device) as
    `leto_runtime.rmu.states.Layout` lays it out in GEOMETRY's pages."""
    from leto_runtime.rmu.states import Layout
    lay = Layout.of([(n, tuple(p.shape)) for n, p in model.named_parameters()],
                    GEOMETRY["page_bytes"])
    return lay.nbytes // GEOMETRY["page_bytes"]


def _examples() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))


def gpt_pages() -> int:
    """Pages of one model state of examples/gpt_inplace.py's tiny GPT."""
    _examples()
    import torch
    from gpt import GPT, GPTConfig
    with torch.device("meta"):
        return model_pages(GPT(GPTConfig.tiny()))


BYO_WIDTH = 128        # examples/byo_train.py --width: 37 pages per state, two protection groups


def byo_args(ddp: bool) -> list[str]:
    """examples/byo_train.py's arguments in the matrix: AdamW + LambdaLR with clipping, two
    parameter groups, DDP or not (tests/integration/test_byo_exactness.py: odd seeds)."""
    return ["--steps", str(STEPS), "--width", str(BYO_WIDTH), "--opt", "adamw",
            *(["--ddp"] if ddp else [])]


def byo_pages(width: int) -> int:
    """Pages of one model state of examples/byo_train.py's model at `--width`."""
    _examples()
    import torch
    from byo_model import ByoNet
    with torch.device("meta"):
        return model_pages(ByoNet(width))


@dataclass
class Schedule:
    seed: int
    category: str
    world: int
    injects: list[str] = field(default_factory=list)
    hang_timeout: float = 30.0
    expect_inplace: int = 1          # in-place recoveries that must happen at least
    demote: str = "replace"          # what survivors do: replace | release (in process)
    forge: int | None = None         # rank whose next go key a process without the job's key
                                     # sets mid-run (the test does it): the job must stop, exit 5

    def script_args(self) -> list[str]:
        """A forged schedule's steps are slowed so that the shadows wait, and look at their go
        key, before the schedule's first HOF promotes them (losses do not depend on time)."""
        return ["--step-time", "2"] if self.forge is not None else []

    def leto_args(self) -> list[str]:
        g = GEOMETRY
        args = ["--standalone", "--nproc-per-node", str(self.world),
                "--page-bytes", str(g["page_bytes"]), "--data-pages", str(g["data_pages"]),
                "--tier1", str(g["tier1"]), "--tier2", str(g["tier2"]),
                "--chunk-pages", str(g["chunk_pages"]), "--hang-timeout", str(self.hang_timeout),
                "--max-restarts", "2", "--demote", self.demote]
        for s in self.injects:
            args += ["--inject", s]
        return args


def schedule(seed: int, pages_per_state: int | None = None) -> Schedule:
    rng = random.Random(seed)
    n_pages = pages_per_state or gpt_pages()
    D, C = GEOMETRY["data_pages"], GEOMETRY["chunk_pages"]
    n_groups = math.ceil(n_pages / D)
    group_k = [min(D, n_pages - g * D) for g in range(n_groups)]
    cat = CATEGORIES[seed % len(CATEGORIES)]
    world = 3 if seed % 7 == 6 else 2
    s = Schedule(seed, cat, world)
    s.demote = os.environ.get("LETO_EXACTNESS_DEMOTE") or ("release" if (seed // 10) % 2 else "replace")
    step = rng.randint(2, 7)

    def rmu_kill(rank: int, t: int, gen: int = 0) -> tuple[str, int]:
        point = rng.choice(RMU_POINTS)
        g = rng.randrange(n_groups)
        spec = f"kill:rank={rank}:step={t}:at={point}"
        if gen:
            spec += f":gen={gen}"
        if point in ("rmu.undo", "rmu.update", "rmu.delta", "rmu.commit"):
            spec += f":group={g}:chunk={rng.randrange(math.ceil(group_k[g] / C))}"
            if point in ("rmu.update", "rmu.delta") and rng.random() < 0.7:
                spec += ":garbage=1"
        elif point in ("rmu.load", "rmu.writeback", "rmu.tier2"):
            spec += f":group={g}"
        return spec, g

    def pages(rank: int, t: int, point: str, g: int) -> list[str]:
        state = rng.randrange(3)                   # params, exp_avg, exp_avg_sq
        pool_group = state * n_groups + g          # pool-wide ids follow allocation order
        first = rng.randint(0, group_k[g] - 16) if group_k[g] >= 16 else 0
        count = min(16, group_k[g])
        return [f"pages:rank={rank}:step={t}:at={point}:tier=device:group={pool_group}:"
                f"first={first}:count={count}",
                f"pages:rank={rank}:step={t}:at={point}:tier=host:part=p1:group={pool_group}:"
                f"first={rng.randrange(GEOMETRY['tier1'])}:count=1"]

    r = rng.randrange(world)
    if cat == "compute":
        s.injects.append(f"kill:rank={r}:step={step}:at={rng.choice(COMPUTE_POINTS)}")
    elif cat == "sync":
        s.injects.append(f"kill:rank={r}:step={step}:at={rng.choice(SYNC_POINTS)}")
    elif cat == "rmu":
        s.injects.append(rmu_kill(r, step)[0])
    elif cat == "rmu+pages":
        spec, g = rmu_kill(r, step)
        point = spec.split(":at=")[1].split(":")[0]
        s.injects += pages(r, step, point, g) + [spec]     # pages first: they fire, then the kill
    elif cat == "two-ranks":
        a, b = rng.sample(range(world), 2)
        if rng.random() < 0.5:                 # both before the gradient all-reduce
            s.injects += [f"kill:rank={a}:step={step}:at={rng.choice(COMPUTE_POINTS[:3])}",
                          f"kill:rank={b}:step={step}:at={rng.choice(COMPUTE_POINTS[:3])}"]
        else:                                  # both after the global synchronization
            s.injects += [rmu_kill(a, step)[0], rmu_kill(b, step)[0]]
    elif cat == "during-recovery":
        spec, g = rmu_kill(r, step)
        s.injects += pages(r, step, spec.split(":at=")[1].split(":")[0], g) + [spec]
        r2 = rng.randrange(world)
        s.injects.append(f"kill:rank={r2}:step=0:gen=1:at={rng.choice(RECOVERY_POINTS)}")
    elif cat == "hang":
        point = rng.choice(("step", "backward", "rmu.update", "sync.after"))
        s.injects.append(f"hang:rank={r}:step={step}:at={point}")   # (hang takes no group=)
        s.hang_timeout = 6.0      # survivors wait in collectives too: not much shorter on 2 cores
    elif cat == "two-generations":
        s.injects.append(rmu_kill(r, step)[0])
        s.injects.append(f"kill:rank={rng.randrange(world)}:step={step + 5}:gen=1:"
                         f"at={rng.choice(COMPUTE_POINTS + SYNC_POINTS + RMU_POINTS[1:3])}")
    _mix_in(seed, s, step, n_groups, group_k)
    return s


def _mix_in(seed: int, s: Schedule, step: int, n_groups: int, group_k: list[int]) -> None:
    """Latent and survivor page losses (module docstring), from their own random stream."""
    rng = random.Random(seed * 7919 + 17)
    if rng.random() < 0.12:
        s.forge = rng.randrange(s.world)
    kills = [x for x in s.injects if x.startswith(("kill:", "hang:")) and ":gen=" not in x]
    if rng.random() < 0.5 and step >= 2:
        r, g = rng.randrange(s.world), rng.randrange(3 * n_groups)
        t0 = rng.randint(1, step - 1)
        if rng.random() < 0.6:
            part = rng.choice(("p1", "p2"))
            rows = GEOMETRY["tier1"] if part == "p1" else GEOMETRY["tier2"]
            s.injects.insert(0, f"pages:rank={r}:step={t0}:tier=host:part={part}:group={g}:"
                                f"first={rng.randrange(rows)}:count=1")
        else:
            k = group_k[g % n_groups]
            n = rng.randint(1, min(4, k))
            s.injects.insert(0, f"pages:rank={r}:step={t0}:tier=device:group={g}:"
                                f"first={rng.randint(0, k - n)}:count={n}")
    if kills and s.world > 1 and rng.random() < 0.4:
        spec = kills[0]
        killed = int(spec.split(":rank=")[1].split(":")[0])
        at = spec.split(":at=")[1].split(":")[0] if ":at=" in spec else "step"
        t = int(spec.split(":step=")[1].split(":")[0])
        r = rng.choice([x for x in range(s.world) if x != killed])
        g = rng.randrange(3 * n_groups)
        k = group_k[g % n_groups]
        n = rng.randint(1, min(4, k))
        s.injects.insert(0, f"pages:rank={r}:step={t}:at={at}:tier=device:group={g}:"
                            f"first={rng.randint(0, k - n)}:count={n}")
        s.injects.insert(0, f"pages:rank={r}:step={t}:at={at}:tier=host:part=p1:group={g}:"
                            f"first={rng.randrange(GEOMETRY['tier1'])}:count=1")


def _rank(spec: str) -> int:
    return int(spec.split(":rank=")[1].split(":")[0])


def fault_classes(s: Schedule) -> set[str]:
    """What a schedule's run exercises, as class names (DEFAULT_SEEDS must hold them all).

    A forged schedule stops at the forged go key, before its HOFs: it counts as `forge` only."""
    if s.forge is not None:
        return {"forge"}
    out = {f"category:{s.category}", f"demote:{s.demote}", f"world:{s.world}"}
    failed = {_rank(x) for x in s.injects if x.startswith(("kill:", "hang:")) and ":gen=" not in x}
    for x in s.injects:
        kind = x.split(":")[0]
        at = x.split(":at=")[1].split(":")[0] if ":at=" in x else "step"
        if kind in ("kill", "hang"):
            out.add(f"at={at}")                   # (category:hang tells a hang apart)
            if ":garbage=1" in x:
                out.add("partially written chunk")
        elif kind == "pages" and ":at=" not in x:
            part = x.split(":part=")[1].split(":")[0] if ":part=" in x else "data"
            out.add(f"latent loss:{part}")
        elif kind == "pages":
            out.add("pages lost with the kill:" + ("survivor" if _rank(x) not in failed
                                                    else "killed rank"))
    return out


if __name__ == "__main__":
    seed, byo = int(sys.argv[1]), "--byo" in sys.argv[2:]
    sch = schedule(seed, byo_pages(BYO_WIDTH) if byo else None)
    print(f"# seed {sch.seed}: {sch.category}, world {sch.world}")
    script = (["examples/byo_train.py", *byo_args(seed % 2 == 1)] if byo
              else ["examples/gpt_inplace.py", "--steps", str(STEPS)])
    print("leto-run " + " ".join(sch.leto_args()) + " " + " ".join(script) +
          " --out OUT_DIR " + " ".join(sch.script_args()))
