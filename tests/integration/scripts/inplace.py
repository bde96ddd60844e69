"""A trainer that speaks the in-place recovery protocol directly (no leto_runtime.job).

usage: inplace.py MODE [STEPS] [SLEEP]
  ok            train STEPS all-reduce steps; every rank writes result_<rank> = "gen G last S"
  unrecoverable active rank 1 exits with contract.UNRECOVERABLE_EXIT at step 3
  shadowdie     the rank-1 shadow of generation 1, epoch 0, dies before its promotion; the actives wait at
                step 3 until every shadow of epoch 1 formed its process group
  reclaim       active rank 0 sends, at step 3 once the shadows are ready, the `reclaim`
                datagram cuda/lend_alloc.cpp sends for 1 GiB (leto_runtime.rmu.lend)
  forkchild     as ok, and active rank 1 of generation 0 forks a child that sleeps (a
                data-loader worker: it holds the exit fence as it would hold device files)
  setsidchild   as forkchild, and the child daemonizes (setsid, fork again): neither the
                agent's kill of the dead trainer's group nor of its children reaches it
  devicechild   active rank 1 of generation 0 opens "a device file" ($LETO_DEVICE_FILES + "0")
                below its exit fence (so the fence is untrusted) and forks a daemon that holds
                it and keeps "working": it appends its clock to that path + ".writes" every
                5 ms, as a forked child keeps a dead trainer's GPU context and kernels alive

Active: announce in-place mode, form the generation's gloo group over
PrefixStore(pg_prefix(gen, epoch), worker store), train.  Shadow: form the group first (level
L3), announce readiness, wait for promotion, report recovery phases, resume at the lowest step
any rank had started, train.  Each step prints `rank= gen= step= value=`.
"""
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from leto_runtime.wire import contract as C
import leto_runtime as hb
from leto_runtime import promotion
from leto_runtime.context import Context

MODE = sys.argv[1] if len(sys.argv) > 1 else "ok"
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 10
SLEEP = float(sys.argv[3]) if len(sys.argv) > 3 else 0.1
ctx = Context.from_env()
store = promotion.worker_store(ctx, timeout=60)


def form_group() -> float:
    t0 = time.monotonic()
    prefix = dist.PrefixStore(C.pg_prefix(ctx.generation, ctx.shadow_epoch), store)
    dist.init_process_group("gloo", store=prefix, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=datetime.timedelta(seconds=30))
    return time.monotonic() - t0


def device_child() -> None:
    dev = os.environ["LETO_DEVICE_FILES"] + "0"
    fd = os.open(dev, os.O_RDWR | os.O_CREAT, 0o600)
    os.dup2(fd, 0)                       # below the fence, which took the lowest free fd
    os.close(fd)
    from leto_runtime import exit_notice
    fence = exit_notice._fence
    assert not exit_notice.check_fence(), f"the fence ({fence}) should now be untrusted: " \
        + str({n: os.readlink(f"/proc/self/fd/{n}") for n in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{n}")})
    if os.fork() == 0:
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        end = time.monotonic() + 60
        with open(dev + ".writes", "a") as w:
            while time.monotonic() < end:
                w.write(f"{time.monotonic()}\n")
                w.flush()
                time.sleep(0.005)
        os._exit(0)


if ctx.role == "active":
    if MODE == "devicechild" and ctx.rank == 1 and ctx.generation == 0:
        device_child()
    if MODE in ("forkchild", "setsidchild") and ctx.rank == 1 and ctx.generation == 0 \
            and os.fork() == 0:
        if MODE == "setsidchild":        # a daemon: its own session, no longer our child
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
        time.sleep(60)
        os._exit(0)
    promotion.announce_inplace()
    form_group()
    start = 0
else:
    if MODE == "shadowdie" and ctx.rank == 1 and ctx.shadow_epoch == 0 and ctx.generation == 1:
        print(f"rank={ctx.rank} shadow epoch 0: dying before promotion", flush=True)
        sys.exit(3)
    seconds = form_group()
    store.set(f"test/ready/{ctx.rank}/{ctx.shadow_epoch}", "1")
    promotion.announce_inplace({"level": "L3", "seconds": seconds})
    woke = promotion.wait_for_promotion(ctx, store)
    t = time.monotonic()
    promotion.report_phase("attach", time.monotonic() - t, pages=0)
    start = min(int(store.get(f"test/step/{r}")) for r in range(ctx.world_size))
    promotion.report_phase("agree", 0.0005, resume="redo", step=start)
    promotion.report_phase("resume", time.monotonic() - woke)
    print(f"rank={ctx.rank} gen={ctx.generation} promoted, resuming at step {start}", flush=True)

for step in range(start, STEPS):
    store.set(f"test/step/{ctx.rank}", str(step))
    if MODE == "shadowdie" and step == 3 and ctx.generation == 0:
        store.wait([f"test/ready/{r}/1" for r in range(ctx.world_size)],
                   datetime.timedelta(seconds=60))
    hb.heartbeat(step)
    if MODE == "reclaim" and step == 3 and ctx.generation == 0 and ctx.rank == 0:
        import socket
        from leto_runtime.rmu.lend import reclaim_message
        store.wait([f"test/ready/{r}/0" for r in range(ctx.world_size)],
                   datetime.timedelta(seconds=60))
        head, tail = reclaim_message(ctx)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(f"{head}{1 << 30}{tail}".encode(), ctx.heartbeat_socket)
    if MODE == "unrecoverable" and ctx.rank == 1 and step == 3:
        print("retained state lost", file=sys.stderr, flush=True)
        sys.exit(C.UNRECOVERABLE_EXIT)
    t = torch.tensor([float(ctx.rank + 1 + step)])
    dist.all_reduce(t)
    print(f"rank={ctx.rank} gen={ctx.generation} step={step} value={t.item()}", flush=True)
    time.sleep(SLEEP)

with open(os.path.join(os.environ["OUT_DIR"], f"result_{ctx.rank}"), "w") as f:
    f.write(f"gen {ctx.generation} last {STEPS - 1}")
hb.done()
dist.destroy_process_group()
