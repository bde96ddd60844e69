"""What one machine runs: the model, the ranks, the failure schedule, the time budget.

A `Preset` is plain data; `run.py` turns it into launches.  The schedule is compressed: one
SIGKILL every `mtbf_s` seconds of training, `kills` of them, in a run sized (by the fault-free
reference) to about (kills + 1) * mtbf_s seconds.  The results are extrapolated to the paper's
one failure per ten minutes with the ETTR formula (metrics.extrapolate).

Failure kinds (`kinds`, kill k has kind kinds[k % len]): "hof" (the trainer dies, its GPU and
retained memory stay usable) or "ff" (a failure in-place recovery cannot take).  The default is
HOFs only; `mixed()` alternates hof, ff (the paper's Fig. 10/11 setting).  How each system gets
an FF is systems.py's and launch.py's business.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Preset:
    name: str
    model: str                   # GPTConfig preset name (examples/gpt.py)
    model_args: tuple = ()       # extra train.py options (--n-layer, --block-size, ...)
    batch_size: int = 8          # sequences per rank per step
    nproc: int = 2               # ranks (one node); gloo on CPU, NCCL with one GPU per rank, gloo
                                 # on shared GPUs where there are fewer GPUs than ranks
    mtbf_s: float = 20.0         # one kill every this many seconds of training
    kills: int = 2
    victims: tuple = (1, 0)      # rank of kill k is victims[k % len(victims)]
    leto_args: tuple = ()        # extra leto-run options (both modes)
    leto_env: tuple = ()         # (NAME, VALUE): runtime knobs of leto-run's workers (both modes)
    system_timeout_s: float = 300.0   # one system's launch, start to exit
    budget_s: float | None = None     # the whole harness; systems that no longer fit are skipped
    description: str = ""
    extra: dict = field(default_factory=dict)
    tail_s: float | None = None       # training after the last kill (default: mtbf_s)
    kinds: tuple = ("hof",)           # kind of kill k: kinds[k % len(kinds)], "hof" | "ff"
    kill_phase: str = "any"           # "update": aim each HOF at the middle of an update phase

    def __post_init__(self):
        bad = [k for k in self.kinds if k not in KINDS]
        if not self.kinds or bad:
            raise ValueError(f"preset {self.name}: kinds must be a non-empty tuple of "
                             f"{'/'.join(KINDS)}, got {self.kinds!r}")

    @property
    def train_seconds(self) -> float:
        return self.kills * self.mtbf_s + (self.mtbf_s if self.tail_s is None else self.tail_s)

    def schedule(self) -> list[tuple[float, int]]:
        """[(seconds after the first training step starts, rank)], one per kill."""
        return [((k + 1) * self.mtbf_s, self.victims[k % len(self.victims)])
                for k in range(self.kills)]

    def kill_kinds(self) -> list[str]:
        """The kind of each kill of `schedule()`, in its order."""
        return [self.kinds[k % len(self.kinds)] for k in range(self.kills)]

    @property
    def ff_fraction(self) -> float:
        """The share of the schedule's failures that are FFs (0 for HOFs only)."""
        kinds = self.kill_kinds()
        return kinds.count("ff") / len(kinds) if kinds else 0.0


KINDS = ("hof", "ff")
MIXED = ("hof", "ff")        # --mixed: half of the failures HOFs, half FFs, alternating


# Small pages on CPU, as configs/inplace_demo.yaml: the tiny model spans several protection groups.
_CPU_LETO = ("--page-bytes", "16384", "--data-pages", "64", "--tier1", "16", "--tier2", "1",
             "--chunk-pages", "8")

PRESETS = {
    "cpu-smoke": Preset(
        name="cpu-smoke", model="tiny", batch_size=4, nproc=2, mtbf_s=1.5, kills=1,
        # a run sized by a reference measured on a busy machine can be over by 1.5 s when the
        # machine frees up: the kill then meets a finished job (CI, 2026-12-02)
        tail_s=4.5,
        victims=(1,), leto_args=_CPU_LETO, system_timeout_s=60.0, budget_s=170.0,
        description="CI smoke test: tiny GPT (114k parameters), 2 gloo ranks, one SIGKILL "
                    "1.5 s into a ~3 s run; checks that the harness works, not performance"),
    "cpu": Preset(
        name="cpu", model="small", batch_size=8, nproc=2, mtbf_s=20.0, kills=2,
        victims=(1, 0), leto_args=_CPU_LETO, system_timeout_s=480.0, budget_s=1800.0,
        description="CPU: small GPT (1.8M parameters), 2 gloo ranks, a SIGKILL every 20 s "
                    "(rank 1, then rank 0) over a ~60 s run"),
    # GPT-3 XL width (2048, 16 heads, vocabulary 50304) with 18 layers and 1024-token
    # sequences: 1.11B parameters, 17.8 GB of fp32 parameters + gradients + AdamW moments,
    # a 13 GB checkpoint.  4 MiB pages halve the per-page attach cost of the promoted trainer
    # (docs/BENCHMARKS.md, Resilient Memory Pool) and keep the slot under the fd limit.
    "h200": Preset(
        name="h200", model="gpu_1b", model_args=("--n-layer", "18", "--block-size", "1024"),
        batch_size=8, nproc=1, mtbf_s=15.0, kills=2, victims=(0,),
        leto_args=("--page-bytes", "4194304", "--hang-timeout", "120"),
        system_timeout_s=240.0, budget_s=540.0,
        description="one H200: 1.11B-parameter GPT, world size 1 with NCCL, bf16 autocast, "
                    "a SIGKILL every 15 s over a ~45 s run"),
}

# The h200 preset's width with 6 layers (0.41B parameters): its checkpoint is written well before
# a mixed schedule's first FF, and reference + both systems + the kernel build fit in one call.
PRESETS["h200-mid"] = replace(
    PRESETS["h200"], name="h200-mid", model_args=("--n-layer", "6", "--block-size", "1024"),
    mtbf_s=20.0, system_timeout_s=200.0, budget_s=400.0,
    description="one H200: 0.41B-parameter GPT (the h200 preset's width, 6 layers), world size 1 "
                "with NCCL, bf16 autocast, a failure every 20 s over a ~60 s run")


def mixed(preset: Preset) -> Preset:
    """`preset` with the mixed schedule (hof, ff, hof, ...)."""
    return replace(preset, kinds=MIXED)


def get(name: str, **overrides) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: one of {', '.join(PRESETS)}")
    over = {k: v for k, v in overrides.items() if v is not None}
    return replace(PRESETS[name], **over) if over else PRESETS[name]
