"""A small data-parallel training script, torchrun-style: runs unchanged under `torchrun` and
`leto-run` (restart mode).

gloo on CPU by default, NCCL when CUDA is present.  It checkpoints with
torch.distributed.checkpoint every `--ckpt-every` steps and resumes from the last checkpoint
after a restart, the way torchrun users write fault-tolerant scripts today.  Data and
initialisation are functions of (seed, step, rank), so a restarted run recomputes the same
steps.  `leto_runtime.heartbeat(step)` gives leto-run hang detection and step-triggered
injections; it is a no-op under torchrun.
"""
import argparse
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

import leto_runtime as leto


def batch(step: int, rank: int, device, dim: int = 32, n: int = 64):
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(n, dim, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return x.to(device), y.to(device)


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--ckpt-dir", default=os.environ.get("TOY_CKPT_DIR"),
                   help="default: a directory of this run in the temp dir, removed at the end")
    p.add_argument("--step-time", type=float, default=0.05, help="extra seconds per step")
    a = p.parse_args()
    # No directory given: one per run in the temp dir (the run id is the same in every
    # restart attempt, and differs between runs, so a run never loads another's checkpoint),
    # removed once training is done.
    own_ckpt = a.ckpt_dir is None
    if own_ckpt:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        a.ckpt_dir = os.path.join(tempfile.gettempdir(), f"leto_toy_ckpt_{run_id}")

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    # One GPU per rank with NCCL; NCCL refuses two ranks of one communicator on one GPU, so
    # with fewer GPUs than local ranks the demo trains on the CPU with gloo (and says so).
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    if torch.cuda.is_available() and not cuda and local_rank == 0:
        print(f"{torch.cuda.device_count()} GPU(s) for {local_world} local ranks: "
              "training on the CPU with gloo", flush=True)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(device)
    ddp = DDP(model, device_ids=[local_rank] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": torch.tensor(0)}
    start = 0
    marker = os.path.join(a.ckpt_dir, "latest")
    if attempt > 0 and os.path.exists(marker):
        dcp.load(state, checkpoint_id=open(marker).read().strip())
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
        if rank == 0:
            print(f"attempt {attempt}: resumed from the checkpoint of step {start}", flush=True)

    for step in range(start, a.steps):
        leto.heartbeat(step)
        x, y = batch(step, rank, device)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if a.step_time:
            time.sleep(a.step_time)
        if rank == 0 and step % 5 == 0:
            print(f"step {step:4d}  loss {loss.item():.5f}  (world {world}, attempt {attempt})", flush=True)
        if (step + 1) % a.ckpt_every == 0:
            path = os.path.join(a.ckpt_dir, f"step_{step + 1}")
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": torch.tensor(step + 1)}
            dcp.save(state, checkpoint_id=path)
            dist.barrier()
            if rank == 0:
                os.makedirs(a.ckpt_dir, exist_ok=True)
                with open(marker + ".tmp", "w") as f:
                    f.write(path)
                os.replace(marker + ".tmp", marker)
    leto.done()
    if rank == 0:
        print(f"done: {a.steps} steps, final loss {loss.item():.5f}", flush=True)
        if own_ckpt:   # every rank is past the barrier of the last save: nobody reads it again
            shutil.rmtree(a.ckpt_dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
