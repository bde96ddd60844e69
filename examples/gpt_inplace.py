"""Train a small GPT in place under `leto-run`: the README's main job and the exactness tests.

    leto-run --config configs/inplace_demo.yaml            # 2 ranks, injected failures, report
    torchrun --nproc-per-node 2 examples/gpt_inplace.py    # the same training, no fault tolerance

It uses the runtime API (`leto_runtime.init`; README, "In-place recovery: the runtime API"): the
model is built on the meta device, its parameters are views of retained memory, AdamW runs as RMU
transactions, and the step loop resumes where recovery says.  CPU with gloo by default, the GPU
(bf16 autocast, fp32 master state) when there is one per local rank.

With `--out DIR` every rank appends `{"step", "gen", "loss"}` (loss as float.hex, exact) to
DIR/loss_<rank>.jsonl after each forward pass, and writes DIR/final_<rank>.json with the sha256
of its final parameters and optimizer moments: what the exactness tests compare.
"""
import argparse
import contextlib
import json
import os
import sys
import time

# Bit-reproducible CUDA (cuBLAS needs this before it starts): a resumed run must be comparable
# with the fault-free one, bit for bit (the paper enables the same deterministic modes).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig, batch, init_weights  # noqa: E402

import leto_runtime as leto  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--model", choices=("tiny", "small", "auto"), default="tiny",
                   help="auto: small on CPU, ~57M parameters (8 x 768) on a GPU")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--paper-preset", action="store_true",
                   help="the paper's Appendix A.1 AdamW settings (peak LR 2.2e-4)")
    p.add_argument("--out", default=None, help="directory for per-step losses and final digests")
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--print-every", type=int, default=10)
    p.add_argument("--no-transactions", action="store_true", help="RMU ablation (not exact)")
    p.add_argument("--n-layer", type=int, help="override the preset's layers")
    p.add_argument("--n-embd", type=int, help="override the preset's width")
    a = p.parse_args()

    job = leto.init(seed=a.seed, transactions=not a.no_transactions)
    if a.model == "auto":
        cfg = GPTConfig.small()
        if job.device.type == "cuda":
            import dataclasses
            cfg = dataclasses.replace(cfg, n_layer=8, n_embd=768, n_head=12)
    else:
        cfg = getattr(GPTConfig, a.model)()
    if a.n_layer or a.n_embd:
        import dataclasses
        cfg = dataclasses.replace(cfg, n_layer=a.n_layer or cfg.n_layer,
                                  n_embd=a.n_embd or cfg.n_embd)
    exact = contextlib.nullcontext
    if job.device.type == "cuda":
        # Deterministic kernels (embedding backward, cuBLAS) and the math attention kernel,
        # whose backward has no atomics.
        torch.use_deterministic_algorithms(True)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        exact = lambda: sdpa_kernel([SDPBackend.MATH])  # noqa: E731
    with job.meta_init():
        model = GPT(cfg)
    model = job.retain(model, init=init_weights)
    if a.paper_preset:
        ocfg = leto.AdamWConfig.paper(total_steps=a.steps)
    else:
        ocfg = leto.AdamWConfig(lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                clip_grad_norm=1.0, warmup_steps=max(1, a.steps // 10),
                                total_steps=a.steps, min_lr=a.lr / 10)
    opt = job.adamw(model, ocfg)

    def warm():                     # a waiting shadow's forward (job.warmup): one sequence
        idx, targets = batch(a.seed, 0, job.rank, a.batch_size, cfg, job.device)
        with job.autocast(), exact():
            return model(idx[:1], targets[:1])      # (logits, loss): the backward's warm-up
    job.warmup(warm)
    log = open(os.path.join(a.out, f"loss_{job.rank}.jsonl"), "a") if a.out else None
    gen = job.ctx.generation
    for step in job.steps(a.steps):
        idx, targets = batch(a.seed, step, job.rank, a.batch_size, cfg, job.device)
        with job.autocast(), exact():
            loss = model(idx, targets)[1]   # the logits die here, not after opt.step()
        value = loss.item()
        if log:
            log.write(json.dumps({"step": step, "gen": gen, "loss": float(value).hex()}) + "\n")
            log.flush()
        with exact():
            loss.backward()
        opt.step()
        if a.step_time:
            time.sleep(a.step_time)
        if job.rank == 0 and (step % a.print_every == 0 or step == a.steps - 1):
            print(f"step {step:4d}  loss {value:.4f}  lr {opt.lr:.2e}  (generation {gen}, "
                  f"{job.role}, world {job.world_size}, {job.device})", flush=True)
    if a.out:
        with open(os.path.join(a.out, f"final_{job.rank}.json"), "w") as f:
            json.dump({"digest": job.state_digest(), "recovery": job.recovery_info,
                       "gen": gen}, f, default=str)


if __name__ == "__main__":
    main()
