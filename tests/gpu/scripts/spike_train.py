"""examples/byo_train.py's model and optimizer with one sudden allocation: in step `--spike-step`
of generation 0, inside forward, `--spike-mib` MiB on the device (an activation spike: a longer
batch, a routed MoE layer).  Before it the script writes `--out`/ready and waits for the file
`--go` (the test fills the device meanwhile).  Losses go to `--out`/loss_<rank>.jsonl."""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                "examples"))
from byo_model import ByoNet, byo_init, freeze, groups, make_optimizer, tokens  # noqa: E402

import leto_runtime as leto  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--spike-step", type=int, default=4)
    p.add_argument("--spike-mib", type=int, default=4096)
    p.add_argument("--go", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    job = leto.init(seed=0, device="cuda")
    with job.meta_init():
        model = ByoNet(1024)
    model = job.retain(model, init=byo_init)
    freeze(model)
    torch_opt, scheduler = make_optimizer("adamw", groups(model, lr2=2e-3))
    opt = job.optimizer(torch_opt, scheduler, clip_grad_norm=0.5)
    log = open(os.path.join(a.out, f"loss_{job.rank}.jsonl"), "a")
    for step in job.steps(a.steps):
        _, loss = model(*(x.to(job.device) for x in tokens(step, job.rank)))
        if step == a.spike_step and job.ctx.generation == 0:
            with open(os.path.join(a.out, "ready"), "w") as f:
                f.write(str(os.getpid()))
            while not os.path.exists(a.go):
                leto.heartbeat(step)
                time.sleep(0.05)
            x = torch.ones(a.spike_mib << 20, dtype=torch.uint8, device=job.device)
            loss = loss + (x[:1].float().sum() * 0)
            del x
        loss.backward()
        opt.step()
        log.write(json.dumps({"step": step, "gen": job.ctx.generation,
                              "loss": float(loss.item()).hex()}) + "\n")
        log.flush()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
