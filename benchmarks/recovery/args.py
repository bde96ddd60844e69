"""The recovery harness's command line (`python -m benchmarks.recovery --help`): parsed and
checked before anything runs (exit 2 with the problem named).  Calling contract:
`parse_args(argv) -> argparse.Namespace` with `system_list` (systems.System) and
`leto_env_pairs` ((NAME, VALUE) of `--leto-env`) added."""
from __future__ import annotations

import argparse

from benchmarks.recovery import presets, systems


def parse_args(argv):
    p = argparse.ArgumentParser(description="Recovery time and ETTR: Leto in place next to "
                                            "torchrun + DCP, in one run",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(presets.PRESETS), default="cpu-smoke")
    p.add_argument("--systems", help="comma-separated faulted systems (default: "
                   + ",".join(s.name for s in systems.FAULTED) + "; with --mixed: "
                   + ",".join(s.name for s in systems.MIXED_DEFAULT) + ")")
    p.add_argument("--mixed", action="store_true",
                   help="mixed schedule: kills alternate HOF, FF (an FF is not recoverable in "
                        "place: leto-ckpt falls back to its checkpoint)")
    p.add_argument("--mtbf", type=float, help="override the preset's seconds between kills")
    p.add_argument("--kills", type=int, help="override the preset's number of kills")
    p.add_argument("--nproc", type=int, help="override the preset's ranks (one node; one GPU "
                                             "each with NCCL where there are enough, else "
                                             "sharing them with gloo, in every system): "
                                             "recovery time versus world size")
    p.add_argument("--budget", type=float, help="override the preset's total time budget (s)")
    p.add_argument("--leto-args", help="override the preset's extra leto-run options (both "
                                       "modes), e.g. \"--page-bytes 2097152 --hang-timeout 120\"")
    p.add_argument("--leto-env", action="append", default=[], metavar="NAME=VALUE",
                   help="a runtime knob for leto-run's workers (both modes; repeatable), e.g. "
                        "LETO_WARMUP_MIB=4096: the harness drops LETO_* variables of its own "
                        "environment, so that nothing changes a system behind the report's back")
    p.add_argument("--phases", action="store_true",
                   help="leto systems: time each step's forward, backward and optimizer step "
                        "apart (train.py --phases; synchronized, so the step is a little slower) "
                        "and report the first step after each recovery by phase")
    p.add_argument("--kill-phase", choices=("any", "update"), help="update: aim each HOF at "
                   "the middle of an update phase (launch.update_target)")
    p.add_argument("--profile", action="store_true",
                   help="leto systems: cProfile the first two steps of each promoted trainer "
                        "(train.py --profile; .pstats files beside the step records)")
    p.add_argument("--work-dir", help="keep logs, step files and checkpoints here "
                                      "(default: a temp dir, removed at the end)")
    p.add_argument("--json", metavar="FILE", help="write every figure here")
    p.add_argument("--md", metavar="FILE", help="write the Markdown report here too")
    p.add_argument("--continue", dest="cont", metavar="FILE",
                   help="continue the run whose JSON is FILE (same preset, machine and Leto "
                        "sources): keep its reference and systems, run the missing systems")
    a = p.parse_args(argv)
    default = systems.MIXED_DEFAULT if a.mixed else systems.FAULTED
    names = ([n.strip() for n in a.systems.split(",") if n.strip()] if a.systems
             else [s.name for s in default])
    bad = [n for n in names if n not in systems.BY_NAME or n == systems.REFERENCE.name]
    if bad:
        p.error(f"--systems: unknown {bad}; choose from "
                f"{', '.join(s.name for s in systems.ALL_FAULTED)}")
    a.system_list = [systems.BY_NAME[n] for n in names]
    try:
        a.leto_env_pairs = tuple(systems.leto_knob(x) for x in a.leto_env)
    except ValueError as e:
        p.error(str(e))
    if a.kills is not None and a.kills < 1:
        p.error(f"--kills must be >= 1, got {a.kills}")
    if a.nproc is not None and not 1 <= a.nproc <= 64:
        p.error(f"--nproc must be in 1..64, got {a.nproc}")
    return a
