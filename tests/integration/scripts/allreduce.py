"""gloo data-parallel toy: all-reduce each step; rank 0 writes the final sum to $OUT_DIR.
Optional: `--fail-rank R --fail-step S` exits 9 on rank R at step S in restart attempt 0."""
import argparse
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import leto_runtime as leto


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-step", type=int, default=-1)
    a = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    total = 0.0
    for step in range(a.steps):
        leto.heartbeat(step)
        if rank == a.fail_rank and step == a.fail_step and attempt == 0:
            raise ValueError(f"planted failure on rank {rank} at step {step}")
        t = torch.tensor([float(rank + 1 + step)])
        dist.all_reduce(t)
        total += t.item()
    if rank == 0:
        with open(os.path.join(os.environ["OUT_DIR"], "result"), "w") as f:
            f.write(f"{world} {total} {attempt}")
    leto.done()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
