"""A process SIGKILLed while its folded chunk kernel runs, and what the kernel left behind.

The folded chunk (cuda/adamw_ws.cu with counts; leto_runtime/rmu/fold.py) promises: at any
instant, for every 512-byte unit, the undo copy of every stage below the unit's visible count is
complete, and no stage at or above it has a new value stored.  Recovery rests on that.  Here the
promise meets a real kill: this process owns the memory (states, undo buffer, counts, parity),
a child maps it (CUDA IPC), launches the kernel on a long chunk -- 60,000 pages of 8 KiB, four
CTAs working through 30,000 stages, tens of ms -- and SIGKILLs itself `delay` ms after the
launch; the driver's teardown stops the kernel wherever it is.  After the child is reaped (its
context is gone, so no kernel of it can write any more) this process reads what is there and
checks the promise unit by unit, then restores the chunk as recovery does and compares it with
the values before the kernel, bit for bit.

`trial(delay_s)` -> dict (the counts seen, the checks); `python -m benchmarks.fold_kill` runs
a few delays and prints them.  tests/gpu/test_fold_kill_gpu.py asserts on them.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch

S = 8 << 10            # page bytes: 4 CTAs of 2 KiB tiles, 16 units
N = 60000              # pages: 30,000 stages per CTA
M = 16
TAG = 0x5AFE


def _cfg():
    from leto_runtime.rmu.adamw import AdamWConfig
    return AdamWConfig(lr=2.2e-4, betas=(0.9, 0.95), weight_decay=0.1, clip_grad_norm=1.0)


def _fused(dev):
    from leto_runtime.rmu import fused as F
    f = F.Fused.for_device(dev, _cfg())     # (the folded kernel is ws's whatever the layout)
    if f is None or not f.syndrome_ok(dev) or not f.fold_ok(dev):
        raise RuntimeError(f"the folded chunk kernel is not usable here: {F.why_not or F.why_not_syndrome or F.why_not_fold}")
    return f


def _launch(f, bufs: dict, dev) -> None:
    from leto_runtime.parity import ParityCode
    code = ParityCode(N, M, S, backend="cuda")
    f.chunk_fold_(bufs["state"], bufs["undo"], bufs["g"], step=3, lr=2.2e-4, coef=bufs["coef"], code=code,
                  first=0, outs=bufs["outs"], bases=bufs["bases"], counts=bufs["counts"], tag=TAG)


def victim(bufs: dict, delay_s: float, ready, batch: int = 1) -> None:
    """The child: map the parent's buffers, launch, tell, wait `delay_s`, SIGKILL itself.
    `batch`: the kernel's stages per count (LETO_RMU_FOLD_BATCH, read when the kernel is bound)."""
    os.environ["LETO_RMU_FOLD_BATCH"] = str(batch)
    dev = bufs["g"].device
    f = _fused(dev)
    torch.cuda.synchronize(dev)
    ready.send(time.monotonic())
    _launch(f, bufs, dev)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < delay_s:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _buffers(dev) -> dict:
    gen = torch.Generator(device=dev).manual_seed(11)
    E = N * S // 4
    state = [torch.randn(E, device=dev, generator=gen), torch.randn(E, device=dev, generator=gen) * 1e-3,
             torch.rand(E, device=dev, generator=gen) * 1e-6]
    from leto_runtime.rmu import fold as FD
    stale = ((TAG - 1) << 16) | FD.n_stages(N)            # the chunk before: all stages counted
    return {"state": state, "undo": [torch.full_like(t, float("nan")) for t in state],
            "g": torch.randn(E, device=dev, generator=gen) * 1e-2,
            "coef": torch.tensor(0.5, device=dev),
            "outs": [torch.zeros(M, S, dtype=torch.uint8, device=dev) for _ in range(3)],
            "bases": [torch.randint(0, 256, (M, S), dtype=torch.uint8, device=dev, generator=gen) for _ in range(3)],
            "counts": [torch.full((FD.units(S),), stale, dtype=torch.int64, device=dev) for _ in range(2)]}


def kernel_ms(dev) -> float:
    """How long the kernel runs here (in this process, on scratch buffers)."""
    f = _fused(dev)
    b = _buffers(dev)
    _launch(f, b, dev)
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    _launch(f, b, dev)
    torch.cuda.synchronize(dev)
    return (time.perf_counter() - t0) * 1e3


def check(bufs: dict, before: list[torch.Tensor]) -> dict:
    """The promise, unit by unit, and the restore's result."""
    from leto_runtime.rmu import fold as FD
    c = [FD.read_counts([x], TAG, N) for x in bufs["counts"]]
    mask = FD.restore_mask(c[0], N, S)                                     # (N, units)
    u = FD.units(S)
    unit = lambda t: t.view(torch.int32).view(N, u, FD.UNIT_BYTES // 4)    # noqa: E731
    undo_ok = all(bool((unit(d) == unit(b)).all(-1)[mask.to(d.device)].all()) for d, b in zip(bufs["undo"], before))
    untouched = all(bool((unit(s) == unit(b)).all(-1)[~mask.to(s.device)].all())
                    for s, b in zip(bufs["state"], before))
    touched = sum(int((~(unit(s) == unit(b)).all(-1)).sum()) for s, b in zip(bufs["state"], before))
    for i in range(3):
        FD.restore_(bufs["state"][i].view(torch.uint8).view(N, S), bufs["undo"][i].view(torch.uint8).view(N, S), mask)
    restored = all(torch.equal(s.view(torch.int32), b.view(torch.int32)) for s, b in zip(bufs["state"], before))
    full = FD.n_stages(N)
    # lane 0 stores copy 0, then copy 1: a kill between them leaves copy 1 one stage behind
    # (either is a true bound: both had the lower count before any new value of its stage)
    return {"counts": c[0].tolist(), "copies_agree": bool(((c[0] - c[1]) >= 0).all() and ((c[0] - c[1]) <= 1).all()),
            "stages": full,
            "partial": bool(((c[0] > 0) & (c[0] < full)).any()) or len(set(c[0].tolist())) > 1,
            "units_touched_pages": touched, "undo_current_below_count": undo_ok,
            "untouched_at_or_above_count": untouched, "restored_bit_exact": restored}


def trial(delay_s: float, dev=None, batch: int = 1) -> dict:
    """One victim killed `delay_s` after its launch (its kernel counting every `batch` stages);
    the checks of what it left."""
    import torch.multiprocessing as mp
    dev = torch.device(dev or "cuda:0")
    bufs = _buffers(dev)
    before = [t.clone() for t in bufs["state"]]
    torch.cuda.synchronize(dev)
    ctx = mp.get_context("spawn")
    rx, tx = ctx.Pipe(duplex=False)
    p = ctx.Process(target=victim, args=(bufs, delay_s, tx, batch))
    p.start()
    if not rx.poll(120):
        p.kill()
        raise RuntimeError("the victim did not get ready in 120 s")
    rx.recv()
    p.join(60)
    if p.exitcode is None:
        p.kill()
        raise RuntimeError("the victim did not die")
    # reaped: its context is destroyed, no kernel of it can write; read twice to see nothing moves
    torch.cuda.synchronize(dev)
    snap = [t.clone() for t in bufs["state"]]
    time.sleep(0.05)
    still = all(torch.equal(a, b) for a, b in zip(snap, bufs["state"]))
    out = check(bufs, before)
    return {"delay_ms": delay_s * 1e3, "batch": batch, "exitcode": p.exitcode, "still_after_reap": still, **out}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delays-ms", default="0,3,8,20")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    dev = torch.device("cuda:0")
    rows = [{"kernel_ms": kernel_ms(dev)}]
    for d in (float(x) for x in a.delays_ms.split(",")):
        r = trial(d / 1e3, dev)
        r["counts"] = sorted(set(r["counts"]))
        rows.append(r)
        print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
