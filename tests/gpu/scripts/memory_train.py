"""examples/byo_train.py's model and optimizer with the active's memory moved in generation 0,
two ways (tests/gpu/test_preinit_gpu.py):

- `--spike-mib M`: one sudden allocation of M MiB inside forward of step `--at` (an activation
  spike: a longer batch, a routed MoE layer), through the lending pool's allocator;
- `--grow-mib M --grow-steps K`: from step `--at` on, K steps that each keep M MiB more (a
  growing batch or routed-token count), `--hold-steps` at the peak, then all of it released
  (`torch.cuda.empty_cache()`, so the driver sees it go); then the script waits for the file
  `--until` (the test writes it once the shadow is back up) and trains on.

Before step `--at` the script writes `--out`/ready and waits for the file `--go` (the test fills
the device meanwhile).  `--step-sleep` seconds pass in every growth step (beating), so the
growth has a rate the agent can see.  Losses go to `--out`/loss_<rank>.jsonl (examples'
format, and the final digest: `leto_testing.compare_runs`)."""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                "examples"))
from byo_model import ByoNet, byo_init, freeze, groups, make_optimizer, tokens  # noqa: E402
from byo_train import digest  # noqa: E402

import leto_runtime as leto  # noqa: E402


def _wait_for(path: str, step: int, timeout_s: float = 600.0) -> None:
    end = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{path} never appeared")
        leto.heartbeat(step)
        time.sleep(0.05)


def _pause(step: int, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        leto.heartbeat(step)
        time.sleep(min(0.1, seconds))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--at", type=int, default=4)
    p.add_argument("--spike-mib", type=int, default=0)
    p.add_argument("--grow-mib", type=int, default=0)
    p.add_argument("--grow-steps", type=int, default=0)
    p.add_argument("--hold-steps", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=1.0)
    p.add_argument("--go", required=True)
    p.add_argument("--until", default=None)
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
    held: list[torch.Tensor] = []
    peak_end = a.at + a.grow_steps + a.hold_steps
    for step in job.steps(a.steps):
        first = job.ctx.generation == 0
        if first and step == a.at:
            with open(os.path.join(a.out, "ready"), "w") as f:
                f.write(str(os.getpid()))
            _wait_for(a.go, step)
        if first and a.grow_mib and a.at <= step < peak_end:
            _pause(step, a.step_sleep)
        if first and held and step == peak_end:
            held.clear()
            torch.cuda.empty_cache()
            if a.until:
                _wait_for(a.until, step)
        _, loss = model(*(x.to(job.device) for x in tokens(step, job.rank)))
        if first and a.spike_mib and step == a.at:
            x = torch.ones(a.spike_mib << 20, dtype=torch.uint8, device=job.device)
            loss = loss + (x[:1].float().sum() * 0)
            del x
        loss.backward()
        opt.step()
        if first and a.grow_mib and a.at <= step < a.at + a.grow_steps:
            # after opt.step(): outside the lending window, in torch's own pool (memory kept
            # across steps may not live in lent memory: leto_runtime/rmu/lend.py)
            held.append(torch.ones(a.grow_mib << 20, dtype=torch.uint8, device=job.device))
            torch.cuda.synchronize()
        log.write(json.dumps({"step": step, "gen": job.ctx.generation,
                              "loss": float(loss.item()).hex()}) + "\n")
        log.flush()
    torch.cuda.synchronize()
    with open(os.path.join(a.out, f"final_{job.rank}.json"), "w") as f:
        json.dump({"digest": digest(model, opt), "gen": job.ctx.generation}, f)


if __name__ == "__main__":
    main()
