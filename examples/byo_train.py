"""An ordinary torch training script ported to in-place recovery (docs/PORTING.md).

    torchrun --nproc-per-node 2 examples/byo_train.py          # stock torch, no fault tolerance
    leto-run --nproc-per-node 2 examples/byo_train.py          # the same run, recovered in place

With `--ddp` the model is wrapped in DistributedDataParallel, which then averages the
gradients (bucketed, overlapped with backward) instead of `opt.step()`.

The model (examples/byo_model.py) has an output head tied to its embedding, a frozen
sub-module, a constant buffer, and two parameter groups; the script builds its own
`torch.optim` optimizer (`--opt adamw|adam|sgd`) and LR scheduler and hands them to
`job.optimizer` with gradient clipping.  Under torchrun every `job.*` call is stock torch
(leto_runtime.adopted), which makes it the reference the exactness tests compare a leto-run
job with.

`--save-at K --ckpt DIR` saves `job.state_dict()` with torch.distributed.checkpoint when step K
is reached; `--resume --ckpt DIR` starts from it (under either launcher, whichever wrote it).

With `--out DIR` every rank appends `{"step", "gen", "loss", "lrs"}` (floats as float.hex) to
DIR/loss_<rank>.jsonl after each step, and writes DIR/final_<rank>.json with the sha256 of its
final `model.state_dict()` and `opt.state_dict()` (torch's format).
"""
import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from byo_model import ByoNet, byo_init, freeze, groups, make_optimizer, tokens  # noqa: E402

import leto_runtime as leto  # noqa: E402


def digest(model: torch.nn.Module, opt) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    sd = opt.state_dict()
    h.update(json.dumps(sd["param_groups"], sort_keys=True, default=str).encode())
    for i in sorted(sd["state"]):
        for k, v in sorted(sd["state"][i].items()):
            h.update(f"{i}.{k}".encode())
            h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--opt", choices=("adamw", "adam", "sgd"), default="adamw")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--ddp", action="store_true", help="wrap the model in DistributedDataParallel")
    p.add_argument("--out", default=None, help="directory for per-step losses and final digests")
    p.add_argument("--ckpt", default=None, help="torch.distributed.checkpoint directory")
    p.add_argument("--save-at", type=int, default=None,
                   help="save job.state_dict() to --ckpt when this step is reached")
    p.add_argument("--resume", action="store_true", help="start from the checkpoint in --ckpt")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU per local rank)")
    p.add_argument("--step-time", type=float, default=0.0,
                   help="extra seconds per step (tests: shadows that wait before a HOF)")
    p.add_argument("--timing", default=None,
                   help="file for rank 0's per-step seconds: compute (forward + backward, "
                        "DDP's all-reduce included) and update (opt.step())")
    a = p.parse_args()

    job = leto.init(seed=0, device=a.device)
    with job.meta_init():
        model = ByoNet(a.width)
    model = job.retain(model, init=byo_init)
    freeze(model)
    torch_opt, scheduler = make_optimizer(a.opt, groups(model, lr2=2e-3 if a.opt != "sgd" else 0.02))
    opt = job.optimizer(torch_opt, scheduler, clip_grad_norm=a.clip)
    if a.resume:
        template = job.state_dict()             # copies: dcp.load fills them in place
        dcp.load(template, checkpoint_id=a.ckpt)
        job.load_state_dict(template)           # a trainer that recovers in place ignores it
    net = model
    if a.ddp and job.world_size > 1:
        # Leto initializes every rank alike, so DDP's broadcast from rank 0 is not needed
        # (and would write into parameters that are not bound to retained memory yet).
        # find_unused_parameters=True keeps DDP's bucket order fixed (it never rebuilds its
        # buckets), which a recovered run needs for the same bits on 3+ ranks (PORTING.md).
        net = torch.nn.parallel.DistributedDataParallel(
            model, init_sync=False, find_unused_parameters=job.world_size > 2)
    log = open(os.path.join(a.out, f"loss_{job.rank}.jsonl"), "a") if a.out else None
    gen = job.ctx.generation
    times = []
    sync = torch.cuda.synchronize if job.device.type == "cuda" else (lambda: None)
    for step in job.steps(a.steps):
        if step == a.save_at:
            dcp.save(job.state_dict(), checkpoint_id=a.ckpt)
        lrs = [float(g["lr"]).hex() for g in opt.param_groups]    # this step's (resumed) values
        t0 = time.perf_counter()
        _, loss = net(*(x.to(job.device) for x in tokens(step, job.rank)))
        if log:
            log.write(json.dumps({"step": step, "gen": gen, "loss": float(loss.item()).hex(),
                                  "lrs": lrs}) + "\n")
            log.flush()
        loss.backward()
        sync()
        t1 = time.perf_counter()
        opt.step()
        sync()
        times.append((t1 - t0, time.perf_counter() - t1, time.monotonic()))
        if a.step_time:
            time.sleep(a.step_time)
        if job.rank == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}  lr {opt.lr:.2e}  ({job.role}, "
                  f"generation {gen}, world {job.world_size})", flush=True)
    if a.timing and job.rank == 0:
        with open(a.timing, "w") as f:
            json.dump({"compute_s": [c for c, _, _ in times], "update_s": [u for _, u, _ in times],
                       "at": [m for _, _, m in times]}, f)
    if a.out:
        with open(os.path.join(a.out, f"final_{job.rank}.json"), "w") as f:
            json.dump({"digest": digest(model, opt), "gen": gen}, f)


if __name__ == "__main__":
    main()
