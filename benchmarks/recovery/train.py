"""The training job of the recovery benchmark: one GPT, three ways of running it.

    train.py --mode ref  --out D --train-seconds S [--calibrate]   # the fault-free reference
    train.py --mode dcp  --out D --steps N --ckpt sync|async --ckpt-every K --ckpt-dir C
    train.py --mode leto --out D --steps N                         # leto-run, in place
    train.py --mode leto --out D --steps N --opt torch             # ... with torch.optim AdamW

Role: the workload `benchmarks/recovery/run.py` measures under every system.  Model
(`examples/gpt.py`), data (`batch(seed, step, rank)`), AdamW hyper-parameters, batch and step
count are the same in every mode; only the fault tolerance differs:

* **ref**: plain torch (DDP, `torch.optim.AdamW`, fused on GPU / foreach on CPU), no fault
  tolerance.  It sizes the run: after `PROBE_STEPS` steps rank 0 turns `--train-seconds` into a
  step count N (broadcast once) and records it (`plan`).  With `--calibrate`, after step N-1 (the
  timed window is over) it measures the cost of one DCP checkpoint, synchronous and
  asynchronous, on this model and machine (`calib`): what Young's interval is computed from.
* **dcp**: ref + `torch.distributed.checkpoint` every K steps (`dcp.save`, or `dcp.async_save`
  with at most one save in flight); at start it resumes from the newest *complete* checkpoint
  (its `.metadata` exists), so it recovers under `torchrun --max-restarts` and under
  `leto-run --recovery restart` alike.  Only the newest complete checkpoint is kept.
* **leto**: the runtime API (`leto_runtime.init`, retained state, RMU AdamW); under `leto-run`
  a shadow takes over in place.  No checkpoints of its own: with HOFs only, Young's interval is
  infinite (paper §8.1, h = 1).  `--opt torch` builds the script's own `torch.optim.AdamW`
  (same hyper-parameters, a LambdaLR giving `lr_at`) and hands it to `job.optimizer`
  (docs/PORTING.md): the form leto-run's `--checkpoint-dir` fallback needs (mixed HOF/FF
  schedules; after a fallback `job.steps` starts at the checkpoint's step, which the first
  `ready` record says).  The default `--opt rmu` is `job.adamw`, as in the earlier results.

Output contract: every process appends JSON lines to ``D/steps_<rank>.jsonl`` (line-buffered,
one `write` per record, so a SIGKILL leaves whole lines):
  {"ev": "start", rank, pid, mode, role, gen, attempt, t_exec}           process start
  {"ev": "ready", rank, pid, gen, attempt, t, step, load_s}              about to run `step`
  {"ev": "step",  rank, pid, gen, attempt, step, t0, t1, loss, ckpt, ckpt_s}
  {"ev": "ckpt_done", rank, pid, step, t}                                an async save completed
  {"ev": "plan", steps, t_iter}  /  {"ev": "calib", ...}  /  {"ev": "end", rank, pid, t}
Times are `time.monotonic()`: one clock for every process of the machine, the harness's too.
t1 is taken after the step's device work (CUDA synchronized) and after its checkpoint call.
"""
import time

T_EXEC = time.monotonic()   # first statement: process start as the harness's clock sees it

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)
from gpt import GPT, GPTConfig, batch, corpus, init_weights  # noqa: E402

import leto_runtime as leto  # noqa: E402
from leto_runtime.rmu.adamw import AdamWConfig, lr_at  # noqa: E402
from benchmarks.recovery.phases import Phases, Profiler  # noqa: E402

PROBE_STEPS = 5          # ref: steps timed before the run is sized (step 0 is warm-up)
CALIB_PLAIN_STEPS = 3    # ref --calibrate: plain steps that give the per-step baseline
CALIB_ASYNC_MAX_STEPS = 200   # steps trained while an async save writes, before waiting on it
CALIB_SECOND_SAVE_BELOW_S = 2.0


# ---- shared by all modes ---------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("ref", "dcp", "leto"), required=True)
    p.add_argument("--out", required=True, help="directory for steps_<rank>.jsonl")
    p.add_argument("--steps", type=int, help="iterations to train (dcp, leto; ref: a cap)")
    p.add_argument("--train-seconds", type=float, help="ref: size the run to about this long")
    p.add_argument("--calibrate", action="store_true", help="ref: measure DCP save costs after")
    p.add_argument("--model", default="tiny", help="a GPTConfig preset: tiny|small|gpu_1b")
    p.add_argument("--n-layer", type=int)
    p.add_argument("--n-embd", type=int)
    p.add_argument("--n-head", type=int)
    p.add_argument("--block-size", type=int, help="sequence length (and position table)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--ckpt", choices=("sync", "async"), default="sync")
    p.add_argument("--ckpt-every", type=int, default=0, help="dcp: steps between checkpoints")
    p.add_argument("--ckpt-dir", help="dcp / ref --calibrate: checkpoint directory")
    p.add_argument("--opt", choices=("rmu", "torch"), default="rmu",
                   help="leto: job.adamw (rmu) or torch.optim.AdamW through job.optimizer")
    p.add_argument("--phases", action="store_true",
                   help="leto: time forward, backward and the optimizer step of every step "
                        "apart (each synchronized), with the device allocations and the main "
                        "thread's CPU time of each (the step record's `phases`)")
    p.add_argument("--no-warmup", action="store_true",
                   help="leto: register no warm-up forward (job.warmup) for waiting shadows")
    p.add_argument("--profile", action="store_true",
                   help="leto: cProfile the first two steps of the first trainer promoted on "
                        "each rank (prof_<rank>_<step>.pstats in --out; it slows them, so later "
                        "recoveries are the ones to time)")
    a = p.parse_args(argv)
    if a.mode == "ref" and not (a.steps or a.train_seconds):
        p.error("--mode ref needs --train-seconds or --steps")
    if a.mode in ("dcp", "leto") and not a.steps:
        p.error(f"--mode {a.mode} needs --steps")
    if a.mode == "dcp" and (a.ckpt_every < 1 or not a.ckpt_dir):
        p.error("--mode dcp needs --ckpt-every >= 1 and --ckpt-dir")
    if a.calibrate and not a.ckpt_dir:
        p.error("--calibrate needs --ckpt-dir")
    return a


def model_config(a) -> GPTConfig:
    import dataclasses
    cfg = getattr(GPTConfig, a.model)()
    over = {k: v for k, v in (("n_layer", a.n_layer), ("n_embd", a.n_embd),
                              ("n_head", a.n_head), ("block_size", a.block_size)) if v}
    return dataclasses.replace(cfg, **over) if over else cfg


def warmup_factor(cfg: AdamWConfig):
    """LambdaLR's factor for step t: base lr x factor is `lr_at(cfg, t)` bit for bit (the same
    expression, lr * ((t + 1) / W), then lr * 1.0), for a constant LR after warm-up."""
    if cfg.total_steps is not None:
        raise ValueError("warmup_factor: only the constant schedule (total_steps=None)")
    w = cfg.warmup_steps

    def factor(t: int) -> float:
        return (t + 1) / w if t < w else 1.0
    return factor


def adamw_config(a) -> AdamWConfig:
    # Constant LR after warm-up (total_steps=None): the step count of a run is only known once
    # the reference has sized it, and the schedule must not depend on it.
    return AdamWConfig(lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1, clip_grad_norm=1.0,
                       warmup_steps=10, total_steps=None)


@torch.no_grad()
def init_params(model: torch.nn.Module, seed: int) -> None:
    """`examples/gpt.init_weights` on CPU.  On a GPU the same rule with a CUDA generator: the
    CPU generator's normal_ over 1.4B values costs seconds per start, paid by every restart
    that has no checkpoint yet; any deterministic init serves the benchmark, as long as every
    mode uses this one."""
    first = next(model.parameters())
    if first.device.type != "cuda":
        init_weights(model, seed)
        return
    gen = torch.Generator(device=first.device).manual_seed(seed)
    for mod in model.modules():
        for name, p in mod.named_parameters(recurse=False):
            if isinstance(mod, torch.nn.LayerNorm):
                p.fill_(1.0 if name == "weight" else 0.0)
            elif name == "weight":
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.zero_()


class StepLog:
    """The per-rank JSONL file (module docstring).  One write + flush per record."""

    def __init__(self, out: str, rank: int, base: dict):
        os.makedirs(out, exist_ok=True)
        self.f = open(os.path.join(out, f"steps_{rank}.jsonl"), "a", buffering=1)
        self.base = base

    def put(self, ev: str, **fields) -> None:
        self.f.write(json.dumps({"ev": ev, **self.base, **fields}) + "\n")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def attempt_of_env() -> tuple[int, int]:
    return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0) or 0),
            int(os.environ.get("LETO_GENERATION", 0) or 0))


# ---- leto: the runtime API, in place -----------------------------------------------------------
def leto_optimizer(job, model: torch.nn.Module, o: AdamWConfig, kind: str):
    """`job.adamw` (rmu), or the script's own torch AdamW + LambdaLR through `job.optimizer`
    (torch): the same hyper-parameters as the plain modes; foreach=False, the implementation
    Leto reproduces (docs/PORTING.md).  opt.step() then clips, updates and steps the LR."""
    if kind == "rmu":
        return job.adamw(model, o)
    torch_opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                  weight_decay=o.weight_decay, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(torch_opt, warmup_factor(o))
    return job.optimizer(torch_opt, sched, clip_grad_norm=o.clip_grad_norm)


def run_leto(a) -> None:
    job = leto.init(seed=a.seed)
    attempt, gen = attempt_of_env()
    gen = job.ctx.generation
    log = StepLog(a.out, job.rank, {"rank": job.rank, "pid": os.getpid(), "gen": gen,
                                    "attempt": attempt})
    log.put("start", mode="leto", role=job.role, t_exec=T_EXEC)
    cfg = model_config(a)
    with job.meta_init():
        model = GPT(cfg)
    model = job.retain(model, init=init_params)
    opt = leto_optimizer(job, model, adamw_config(a), a.opt)
    if not a.no_warmup:             # a waiting shadow's forward: one sequence of step 0's batch
        def warm():
            idx, tgt = batch(a.seed, 0, job.rank, a.batch_size, cfg, job.device)
            with job.autocast():
                return model(idx[:1], tgt[:1])
        job.warmup(warm)
    first = True
    corpus(a.seed, cfg.vocab_size)     # the data set before the loop, as a script's DataLoader
    prof = Profiler(a.out, job.rank) if a.profile else None
    for step in job.steps(a.steps):
        t0 = time.monotonic()
        if prof is not None:
            prof.begin(promoted=job.recovery_info.get("woke") is not None)
        if first:      # after promotion and recovery (attach, localize, agree, finish/redo)
            log.put("ready", t=t0, step=step, load_s=0.0,      # and what its shadow prepared
                    **{k: v for k, v in job.recovery_info.items()
                       if k in ("rehearsal_s", "lend_prepare_s", "warmup_s", "warmup_backward",
                                "warmup_cap_mib", "warmup_cap_from", "woke")})
            first = False
        phases = Phases(job.device) if a.phases else None
        idx, tgt = batch(a.seed, step, job.rank, a.batch_size, cfg, job.device)
        with job.autocast():
            _, loss = model(idx, tgt)
        if phases:
            phases.mark("fwd")
        loss.backward()
        if phases:
            phases.mark("bwd")
        opt.step()
        sync(job.device)
        if phases:
            phases.mark("opt")
        if prof is not None:
            prof.end(step)
        log.put("step", step=step, t0=t0, t1=time.monotonic(), loss=loss.item(), ckpt=None,
                ckpt_s=0.0, **({"phases": phases.rows} if phases else {}))
    log.put("end", t=time.monotonic())


# ---- ref and dcp: plain torch ---------------------------------------------------------------------
class Plain:
    """Process group, DDP model, torch AdamW with Leto's hyper-parameters, one training step."""

    def __init__(self, a):
        self.a = a
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        # leto_runtime's rule (job._pick_device): ranks share GPUs (gloo) where there are fewer
        cuda = torch.cuda.is_available()
        n = torch.cuda.device_count() if cuda else 0
        per_gpu = cuda and n >= local_world
        self.device = torch.device("cuda", local_rank % n) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        kw = {"device_id": self.device} if per_gpu else {}
        dist.init_process_group("nccl" if per_gpu else "gloo", **kw)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # Checkpoint collectives (and the resume decision) on their own gloo group: an async
        # save runs them in a background thread, which must not interleave with DDP's
        # all-reduces on the training group.
        self.ctl = dist.new_group(backend="gloo")
        self.cfg = model_config(a)
        with torch.device("meta"):
            model = GPT(self.cfg)
        model.to_empty(device=self.device)
        self.model = model
        self.ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[self.device.index] if cuda else None)
        self.ocfg = adamw_config(a)
        o = self.ocfg
        self.opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                     weight_decay=o.weight_decay,
                                     **({"fused": True} if cuda else {"foreach": True}))
        self.autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda \
            else contextlib.nullcontext

    def init_weights(self) -> None:
        init_params(self.model, self.a.seed)

    def step(self, t: int) -> float:
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.ocfg, t)
        idx, tgt = batch(self.a.seed, t, self.rank, self.a.batch_size, self.cfg, self.device)
        torch.manual_seed((self.a.seed * 1_000_003 + t) * 65_537 + self.rank)
        with self.autocast():
            _, loss = self.ddp(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.ocfg.clip_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        sync(self.device)
        return loss.item()

    # -- DCP ---------------------------------------------------------------------------------------
    def state(self, step: int) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd, "step": torch.tensor(step)}

    def save(self, path: str, step: int, kind: str):
        """sync: returns None once the checkpoint is complete; async: returns the future."""
        import torch.distributed.checkpoint as dcp
        if kind == "sync":
            dcp.save(self.state(step), checkpoint_id=path, process_group=self.ctl)
            return None
        return dcp.async_save(self.state(step), checkpoint_id=path, process_group=self.ctl)

    def load(self, path: str) -> int:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict
        st = self.state(0)       # also creates the optimizer's state tensors to load into
        dcp.load(st, checkpoint_id=path, process_group=self.ctl)
        set_state_dict(self.model, self.opt, model_state_dict=st["model"],
                       optim_state_dict=st["optim"])
        return int(st["step"])


def complete_checkpoints(ckpt_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint whose `.metadata` exists (DCP writes it last, on the
    coordinator, after every rank's data is written), oldest first."""
    out = []
    if os.path.isdir(ckpt_dir):
        for name in os.listdir(ckpt_dir):
            path = os.path.join(ckpt_dir, name)
            if name.startswith("step_") and os.path.exists(os.path.join(path, ".metadata")):
                out.append((int(name[5:]), path))
    return sorted(out)


def prune(ckpt_dir: str, keep_step: int) -> None:
    """Rank 0: remove every checkpoint directory but the newest complete one (bounded disk:
    one complete checkpoint plus the one being written)."""
    for name in os.listdir(ckpt_dir):
        if name.startswith("step_") and int(name[5:]) != keep_step:
            shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)


def run_plain(a) -> None:
    attempt, gen = attempt_of_env()
    pl = Plain(a)
    log = StepLog(a.out, pl.rank, {"rank": pl.rank, "pid": os.getpid(), "gen": gen,
                                   "attempt": attempt})
    log.put("start", mode=a.mode, role="plain", t_exec=T_EXEC)
    corpus(a.seed, pl.cfg.vocab_size)     # the data set before the loop (as in run_leto)
    start, load_s = 0, 0.0
    if a.mode == "dcp":
        os.makedirs(a.ckpt_dir, exist_ok=True)
        # Rank 0 picks the checkpoint and tells the others: a decision, not a race of scans.
        pick = [complete_checkpoints(a.ckpt_dir)[-1:] if pl.rank == 0 else None]
        dist.broadcast_object_list(pick, src=0, group=pl.ctl)
        if pick[0]:
            (step, path), = pick[0]
            t = time.monotonic()
            start = pl.load(path)
            load_s = time.monotonic() - t
            if pl.rank == 0:
                prune(a.ckpt_dir, step)    # partial saves of the failed attempt
    if start == 0:
        pl.init_weights()
    sync(pl.device)
    log.put("ready", t=time.monotonic(), step=start, load_s=load_s)
    total = a.steps or 10 ** 9
    pending = None           # (step, future) of the async save in flight
    t_first = None
    step = start
    while step < total:
        t0 = time.monotonic()
        t_first = t_first or t0
        loss = pl.step(step)
        ckpt, ckpt_s = None, 0.0
        if a.mode == "dcp":
            if pending and pending[1].done():
                pending = finish_async(pl, a, log, pending)
            if (step + 1) % a.ckpt_every == 0 and step + 1 < total:
                tc = time.monotonic()
                if pending:          # at most one save in flight: wait for the previous one
                    pending = finish_async(pl, a, log, pending)
                path = os.path.join(a.ckpt_dir, f"step_{step + 1}")
                fut = pl.save(path, step + 1, a.ckpt)
                if fut is None:
                    if pl.rank == 0:
                        prune(a.ckpt_dir, step + 1)
                else:
                    pending = (step + 1, fut)
                ckpt, ckpt_s = a.ckpt, time.monotonic() - tc
        log.put("step", step=step, t0=t0, t1=time.monotonic(), loss=loss, ckpt=ckpt,
                ckpt_s=ckpt_s)
        step += 1
        if a.mode == "ref" and not a.steps and step == PROBE_STEPS:
            total = plan_steps(pl, a, log, t_first)
    if pending:
        finish_async(pl, a, log, pending)
    log.put("end", t=time.monotonic())
    if a.mode == "ref" and a.calibrate:
        calibrate(pl, a, log, total)
    dist.destroy_process_group()


def finish_async(pl: Plain, a, log: StepLog, pending):
    step, fut = pending
    fut.result(timeout=600)
    log.put("ckpt_done", step=step, t=time.monotonic())
    if pl.rank == 0:
        prune(a.ckpt_dir, step)
    return None


def plan_steps(pl: Plain, a, log: StepLog, t_first: float) -> int:
    """Rank 0 sizes the reference run: N steps of about `--train-seconds` in all, from the
    median of the probe steps after the first (warm-up) one.  One broadcast."""
    n = torch.zeros(1, dtype=torch.int64)
    if pl.rank == 0:
        recs = [json.loads(x) for x in open(log.f.name) if '"ev": "step"' in x]
        recs = [r for r in recs if r["pid"] == os.getpid()]
        t_iter = statistics.median(r["t1"] - r["t0"] for r in recs[1:])
        elapsed = time.monotonic() - t_first
        n[0] = PROBE_STEPS + max(1, round((a.train_seconds - elapsed) / t_iter))
        log.put("plan", steps=int(n[0]), t_iter=t_iter, train_seconds=a.train_seconds,
                tokens_per_step=a.batch_size * pl.cfg.block_size * pl.world)
    dist.broadcast(n, src=0, group=pl.ctl)
    return int(n[0])


def all_done(pl: Plain, fut) -> bool:
    """Whether every rank's async save is done: one decision for all ranks, or they would train
    different numbers of steps and DDP's all-reduces would no longer match.  On the training
    group: the checkpoint group is busy in the save's background thread."""
    flag = torch.tensor([1 if fut.done() else 0], device=pl.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def calibrate(pl: Plain, a, log: StepLog, step: int) -> None:
    """After the timed window: the cost C of one checkpoint on this model and machine, as the
    paper measures it (excess time over an iteration without one; Appendix C):
      sync:  the `dcp.save` call (the second of two when the first took under 2 s: the first
             pays one-off set-up; both reported);
      async: the `dcp.async_save` call (staging) + the slow-down of the steps trained while the
             write runs + any wait for it, over the same number of plain steps."""
    d = os.path.join(a.ckpt_dir, "calib")
    os.makedirs(d, exist_ok=True)
    plain = []
    for _ in range(CALIB_PLAIN_STEPS):
        t = time.monotonic()
        pl.step(step)
        step += 1
        plain.append(time.monotonic() - t)
    t_plain = statistics.median(plain)
    sync_s = []
    for k in range(2):
        # A second save only when the first was quick: DCP's one-off set-up (planning, the
        # directory) is well under a second, which matters for a small model and is noise next
        # to a multi-second save of a large one, where a second save would cost the budget.
        if k and sync_s[0] > CALIB_SECOND_SAVE_BELOW_S:
            break
        dist.barrier(group=pl.ctl)
        t = time.monotonic()
        pl.save(os.path.join(d, f"sync_{k}"), step, "sync")
        sync_s.append(time.monotonic() - t)
        if pl.rank == 0:
            shutil.rmtree(os.path.join(d, f"sync_{k}"), ignore_errors=True)
    dist.barrier(group=pl.ctl)
    t = time.monotonic()
    fut = pl.save(os.path.join(d, "async"), step, "async")
    call_s = time.monotonic() - t
    during, n = 0.0, 0
    while not all_done(pl, fut) and n < CALIB_ASYNC_MAX_STEPS:
        t = time.monotonic()
        pl.step(step)
        step += 1
        during += time.monotonic() - t
        n += 1
    t = time.monotonic()
    fut.result(timeout=600)
    wait_s = time.monotonic() - t
    # Every rank must see the write finished before rank 0 deletes it.
    dist.barrier(group=pl.ctl)
    shutil.rmtree(d, ignore_errors=True) if pl.rank == 0 else None
    async_cost = call_s + max(0.0, during - n * t_plain) + wait_s
    log.put("calib", t_plain=t_plain, sync_s=sync_s, sync_cost=sync_s[-1],
            async_call_s=call_s, async_steps=n, async_steps_s=during, async_wait_s=wait_s,
            async_cost=async_cost)


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.mode == "leto":
        run_leto(a)
    else:
        run_plain(a)


if __name__ == "__main__":
    main()
