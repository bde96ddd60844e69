"""A trainer that speaks the in-place protocol (like inplace.py) and fails in the ways the
failure policy must judge (leto_run.decisions.classify_failure).

usage: inplace_policy.py MODE STEPS SLEEP [AT]
  raise    rank 1 raises ValueError at step AT in every generation (no error file)
  record   the same under torch's @record: the traceback lands in the error file
  drift    rank 1 raises ValueError at step AT + 2g in generation g: never twice at one point
  early    rank 1 raises before its first step in every generation (an active right after it
           formed its group, a promoted shadow right after its promotion)
  segv     rank 1 kills itself with SIGSEGV at step AT in every generation
  ok       no failure of its own
Active: announce in-place mode, form the generation's gloo group, train from step 0.  Shadow:
form the group, announce readiness, wait for promotion, resume at the lowest step any rank had
started.  Every rank that finishes writes $OUT_DIR/result_<rank> = "gen G last S".
"""
import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import leto_runtime as hb
from leto_runtime.wire import contract as C
from leto_runtime import promotion
from leto_runtime.context import Context

MODE = sys.argv[1]
STEPS = int(sys.argv[2])
SLEEP = float(sys.argv[3])
AT = int(sys.argv[4]) if len(sys.argv) > 4 else 5
ctx = Context.from_env()
store = promotion.worker_store(ctx, timeout=60)
FAILS = ctx.rank == 1


def form_group() -> None:
    prefix = dist.PrefixStore(C.pg_prefix(ctx.generation, ctx.shadow_epoch), store)
    dist.init_process_group("gloo", store=prefix, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=datetime.timedelta(seconds=30))


def fail_here(step: int | None) -> None:
    if not FAILS:
        return
    at = AT + 2 * ctx.generation if MODE == "drift" else AT
    if MODE == "early" and step is None:
        raise RuntimeError("cannot start: the configuration is impossible")
    if step is not None and step == at and MODE in ("raise", "record", "drift"):
        raise ValueError(f"bad batch at step {step} (generation {ctx.generation})")
    if step is not None and step == at and MODE == "segv":
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGSEGV)


def main() -> None:
    if ctx.role == "active":
        promotion.announce_inplace()
        form_group()
        fail_here(None)
        start = 0
    else:
        form_group()
        promotion.announce_inplace({"level": "L3", "seconds": 0.0})
        promotion.wait_for_promotion(ctx, store)
        fail_here(None)
        keys = [f"test/step/{r}" for r in range(ctx.world_size)]
        started = [int(store.get(k)) for k in keys if store.check([k])]
        start = min(started) if started else 0
        promotion.report_phase("agree", 0.0005, resume="redo", step=start)
    for step in range(start, STEPS):
        store.set(f"test/step/{ctx.rank}", str(step))
        hb.heartbeat(step)
        fail_here(step)
        t = torch.tensor([float(ctx.rank + 1 + step)])
        dist.all_reduce(t)
        print(f"rank={ctx.rank} gen={ctx.generation} step={step} value={t.item()}", flush=True)
        time.sleep(SLEEP)
    with open(os.path.join(os.environ["OUT_DIR"], f"result_{ctx.rank}"), "w") as f:
        f.write(f"gen {ctx.generation} last {STEPS - 1}")
    hb.done()
    dist.destroy_process_group()


if __name__ == "__main__":
    (record(main) if MODE == "record" else main)()
