"""AdamW math for the Resumable Model Updater: LR schedule, gradient clipping, chunked update.

Role: the numerical core of `opt.step()` (docs/RMU.md).  The RMU transaction code owns processes,
parity, undo buffers and markers; this module owns only the arithmetic, so that a chunk can be
updated, rolled back from its undo copy and updated again with the same bits, and so that a run
resumed in place is bit-identical to a fault-free one.  Pure functions of their arguments: no
processes, no I/O, no global state, torch ops only (CPU and CUDA tensors alike).

Calling contract, one iteration `t` (0-based) of a data-parallel job:

    lr   = lr_at(cfg, t)                         # pure function of the step: nothing to retain
    coef = None
    if cfg.clip_grad_norm is not None:
        sq   = grad_sq_norm(grads)               # this rank's part: fp64 0-dim tensor
        # (global synchronization: see grad_sq_norm for what, if anything, to all-reduce)
        coef = clip_coef(total_norm_from_sq(sq), cfg.clip_grad_norm)
    for each chunk (p, m, v, g) of (params, exp_avg, exp_avg_sq, grads):
        adamw_chunk_(p, m, v, g, step=t + 1, lr=lr, cfg=cfg, coef=coef, scratch=buf)

Exactness guarantees (asserted by tests/unit/test_rmu_adamw.py and tests/gpu/...):
  * `total_norm_from_sq(grad_sq_norm(grads))` equals, bitwise, the value that
    `torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)` returns, and `clip_coef`
    equals the clamped coefficient it multiplies the gradients with.
  * `adamw_chunk_` equals, bitwise, `torch.optim.AdamW(..., foreach=False, fused=False)` stepping a
    parameter whose `.grad` is `g * coef` (i.e. after clip_grad_norm_), on the same device.
  * `adamw_chunk_` is position independent: any split of a tensor into chunks gives the bits of
    the whole-tensor update.  Every op used is element-wise and correctly rounded per element
    or (lerp) computed by one formula per element; on the installed CPU torch the vectorized
    loop body and the scalar tail give identical bits for every op used (checked for the
    DEFAULT, AVX2 and AVX512 kernels), and CUDA element-wise kernels run one code path per
    element.  Because TensorIterator's split into threads and vector/tail also moves with the
    chunk boundaries, this independence is what makes the chunked update exact at all.
  * `g` is never written: a chunk interrupted mid-update can be restored from its undo copy and
    redone from the same gradients.

Not bitwise across devices or CPU ISAs (CUDA vs CPU may differ in the last bit; so may AVX2 vs
AVX512): a job must resume on the same kind of device it ran on, which Leto does by construction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "AdamWConfig",
    "lr_at",
    "grad_sq_norm",
    "total_norm_from_sq",
    "clip_coef",
    "adamw_chunk_",
]

# clip_grad_norm_ adds this to the norm before dividing (torch/nn/utils/clip_grad.py).
_CLIP_EPS = 1e-6


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW hyper-parameters plus the LR schedule and clipping (all that `opt.step()` needs
    besides the step number).  Frozen: a job's configuration cannot drift between a run and its
    in-place resumption.

    lr:             peak learning rate (> 0).
    betas:          (beta1, beta2), each in [0, 1).
    eps:            added to sqrt(v_hat) (> 0).
    weight_decay:   decoupled weight decay (>= 0): p *= 1 - lr * weight_decay.
    clip_grad_norm: max global L2 norm of the gradients, or None for no clipping (> 0).
    warmup_steps:   linear warmup over steps 0 .. warmup_steps-1 (>= 0).
    total_steps:    with a value: cosine decay from lr to min_lr over steps
                    warmup_steps .. total_steps-1; None: constant lr after warmup.
    min_lr:         cosine floor, 0 <= min_lr <= lr.
    """

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_grad_norm: float | None = None
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr: float = 0.0

    def __post_init__(self):
        def bad(field: str, fix: str):
            raise ValueError(f"AdamWConfig.{field}={getattr(self, field)!r}: {fix}")

        if not _is_real(self.lr) or not math.isfinite(self.lr) or self.lr <= 0:
            bad("lr", "the peak learning rate must be a finite number > 0, e.g. lr=2.2e-4")
        b = self.betas
        if (not isinstance(b, (tuple, list)) or len(b) != 2
                or not all(_is_real(x) and 0.0 <= x < 1.0 for x in b)):
            bad("betas", "give two numbers in [0, 1), e.g. betas=(0.9, 0.95)")
        if isinstance(b, list):  # keep the frozen config hashable and immutable
            object.__setattr__(self, "betas", tuple(b))
        if not _is_real(self.eps) or not math.isfinite(self.eps) or self.eps <= 0:
            bad("eps", "must be a finite number > 0, e.g. eps=1e-8")
        if not _is_real(self.weight_decay) or not math.isfinite(self.weight_decay) or self.weight_decay < 0:
            bad("weight_decay", "must be a finite number >= 0 (0 disables decay)")
        if self.clip_grad_norm is not None and (
                not _is_real(self.clip_grad_norm) or not math.isfinite(self.clip_grad_norm)
                or self.clip_grad_norm <= 0):
            bad("clip_grad_norm", "must be a finite number > 0, or None to disable clipping")
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            bad("warmup_steps", "must be an int >= 0 (0 disables warmup)")
        if self.total_steps is not None:
            if not _is_int(self.total_steps) or self.total_steps < 1:
                bad("total_steps", "must be an int >= 1, or None for no cosine decay")
            if self.warmup_steps > self.total_steps:
                bad("warmup_steps", f"must not exceed total_steps={self.total_steps}")
        if (not _is_real(self.min_lr) or not math.isfinite(self.min_lr)
                or not 0.0 <= self.min_lr <= self.lr):
            bad("min_lr", f"must be a number in [0, lr={self.lr}]")

    @classmethod
    def paper(cls, total_steps: int) -> "AdamWConfig":
        """The paper's Appendix A.1 preset: betas (0.9, 0.95), weight decay 0.1, eps 1e-8,
        peak LR 2.2e-4 with linear warmup over the first 10% of steps (total_steps // 10),
        cosine decay to 2.2e-5 (peak / 10) at the last step, global-norm clipping at 1.0."""
        if not _is_int(total_steps) or total_steps < 1:
            raise ValueError(f"AdamWConfig.paper(total_steps={total_steps!r}): "
                             "total_steps must be an int >= 1")
        return cls(lr=2.2e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                   clip_grad_norm=1.0, warmup_steps=total_steps // 10,
                   total_steps=total_steps, min_lr=2.2e-5)


def lr_at(cfg: AdamWConfig, step: int) -> float:
    """Learning rate of the 0-based `step`; a pure function, so resuming needs no LR state.

    With W = warmup_steps, T = total_steps, evaluated in Python doubles in exactly this order:
      step < W:                 cfg.lr * ((step + 1) / W)            (exactly lr at step W-1)
      step >= W, T is None:     cfg.lr
      step >= W, T given:       p = min(1, (step - W) / (T - 1 - W))  (p = 1 when T - 1 - W <= 0)
                                c = 0.5 * (1 + cos(pi * p))
                                cfg.lr * c + cfg.min_lr * (1 - c)
    so step W gives exactly lr, step T-1 (the last) gives exactly min_lr, and any later step
    stays at min_lr.
    """
    if not _is_int(step) or step < 0:
        raise ValueError(f"lr_at(step={step!r}): step must be an int >= 0 (0-based)")
    W = cfg.warmup_steps
    if step < W:
        return cfg.lr * ((step + 1) / W)  # ratio first: (W/W) * lr is exactly lr
    if cfg.total_steps is None:
        return cfg.lr
    span = cfg.total_steps - 1 - W
    p = 1.0 if span <= 0 else min(1.0, (step - W) / span)
    c = 0.5 * (1.0 + math.cos(math.pi * p))
    return cfg.lr * c + cfg.min_lr * (1.0 - c)


def grad_sq_norm(grads: list[Tensor]) -> Tensor:
    """This rank's part of the global gradient norm: the square of the L2 norm of `grads`
    (viewed as one vector), as a 0-dim float64 tensor on the gradients' device.

    The norm is computed exactly as `clip_grad_norm_(..., foreach=False)` does (one
    `torch.linalg.vector_norm` per tensor, then the norm of the stacked norms, in fp32 for fp32
    gradients); it is then squared in float64, where the square of an fp32 value is exact, so
    `total_norm_from_sq` recovers that norm bit for bit.

    Global synchronization:
      * Pure data parallelism (every rank holds the full, already all-reduced gradients): the
        local value is the global one.  Nothing needs reducing; if the barrier carries it anyway,
        all-reduce with MAX (all ranks hold the same value), never SUM.
      * Gradients sharded across ranks (each rank holds a disjoint part): all-reduce with SUM,
        then `total_norm_from_sq`.  That is the right norm, but it is not bitwise the value
        clip_grad_norm_ would compute over the unsharded gradients (the summation order differs).

    All gradients must share one device and dtype (clip_grad_norm_ would otherwise group them by
    device and dtype and reorder the norms).
    """
    grads = list(grads)
    if not grads:
        return torch.zeros((), dtype=torch.float64)  # clip_grad_norm_ returns tensor(0.) here
    dev, dt = grads[0].device, grads[0].dtype
    for i, g in enumerate(grads):
        if g.device != dev or g.dtype != dt:
            raise ValueError(f"grad_sq_norm: grads[{i}] is {g.dtype} on {g.device}, grads[0] is {dt} "
                             f"on {dev}; call it once per device/dtype group")
    norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    return total.to(torch.float64).square()


def total_norm_from_sq(sq: Tensor) -> Tensor:
    """The global L2 norm (0-dim float32) from a (possibly all-reduced) `grad_sq_norm` value.
    Exact inverse of grad_sq_norm's squaring: sqrt of an exactly representable square is exact."""
    if sq.dim() != 0 or sq.dtype != torch.float64:
        raise ValueError(f"total_norm_from_sq: expected the 0-dim float64 tensor of grad_sq_norm, "
                         f"got shape {tuple(sq.shape)} {sq.dtype}")
    return sq.sqrt().to(torch.float32)


def clip_coef(total_norm: Tensor, max_norm: float) -> Tensor:
    """The clamped clipping coefficient, 0-dim float32, on total_norm's device:
        clamp(max_norm / (total_norm + 1e-6), max=1.0)
    written with the same tensor expression as clip_grad_norm_ (Python float / tensor is
    `reciprocal() * float` there too), so the bits match.  The gradients are to be multiplied by
    it even when it is 1.0 (clip_grad_norm_ does, and x * 1.0 == x anyway)."""
    if total_norm.dim() != 0 or total_norm.dtype != torch.float32:
        raise ValueError(f"clip_coef: total_norm must be a 0-dim float32 tensor (use "
                         f"total_norm_from_sq), got shape {tuple(total_norm.shape)} {total_norm.dtype}")
    if not _is_real(max_norm) or not max_norm > 0:
        raise ValueError(f"clip_coef: max_norm={max_norm!r} must be a number > 0")
    coef = float(max_norm) / (total_norm + _CLIP_EPS)
    return torch.clamp(coef, max=1.0)


def adamw_chunk_(p: Tensor, m: Tensor, v: Tensor, g: Tensor, *, step: int, lr: float,
                 cfg: AdamWConfig, coef: Tensor | None, scratch: Tensor | None = None) -> None:
    """In-place AdamW update of one chunk.

    p, m, v, g: 1-D float32 tensors of equal length on one device: parameters, exp_avg,
        exp_avg_sq (updated in place) and gradients (read only, never written).
    step:   1-based Adam step count (bias correction); iteration t uses step = t + 1.
    lr:     this iteration's learning rate (lr_at(cfg, t)).
    coef:   clip coefficient from clip_coef (0-dim, on the chunk's device), or None (no clipping).
    scratch: optional 1-D float32 buffer with at least len(p) elements on the same device; its
        first len(p) elements hold g * coef and then the denominator, so the update allocates
        nothing.  Without it, temporaries of the chunk's size are allocated.

    Same ops, same order, same Python scalars as torch.optim.adam._single_tensor_adam with
    decoupled_weight_decay=True (AdamW, foreach=False, fused=False, amsgrad=False):
        gc     = g * coef                                   (g when coef is None)
        p     *= 1 - lr * weight_decay                      (skipped when weight_decay == 0)
        m      = m.lerp(gc, 1 - beta1)
        v      = v * beta2 + (1 - beta2) * gc * gc          (mul_ then addcmul_)
        bc1    = 1 - beta1 ** step;  bc2 = 1 - beta2 ** step    (Python doubles)
        denom  = sqrt(v) / bc2 ** 0.5 + eps
        p     += -(lr / bc1) * m / denom                    (addcdiv_)
    """
    n = p.numel()
    for name, t in (("p", p), ("m", m), ("v", v), ("g", g)):
        if t.dim() != 1 or t.dtype != torch.float32 or t.numel() != n or t.device != p.device:
            raise ValueError(f"adamw_chunk_: {name} must be a 1-D float32 tensor of {n} elements on "
                             f"{p.device}, got shape {tuple(t.shape)} {t.dtype} on {t.device}")
    if not _is_int(step) or step < 1:
        raise ValueError(f"adamw_chunk_: step={step!r} must be the 1-based Adam step (int >= 1)")
    if scratch is not None:
        if (scratch.dim() != 1 or scratch.dtype != torch.float32 or scratch.numel() < n
                or scratch.device != p.device):
            raise ValueError(f"adamw_chunk_: scratch must be a 1-D float32 tensor of >= {n} elements "
                             f"on {p.device}, got shape {tuple(scratch.shape)} {scratch.dtype} "
                             f"on {scratch.device}")
        scratch = scratch[:n]
    beta1, beta2 = cfg.betas
    lr = float(lr)

    if coef is None:
        grad = g
    elif scratch is not None:
        grad = torch.mul(g, coef, out=scratch)
    else:
        grad = g * coef  # clip_grad_norm_ does g.mul_(coef): same kernel, same bits

    if cfg.weight_decay != 0:
        p.mul_(1 - lr * cfg.weight_decay)
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

    # torch reads the step back from a float32 tensor (`.item()`): a float, as here.
    s = float(step)
    bias_correction1 = 1 - beta1 ** s
    bias_correction2 = 1 - beta2 ** s
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5

    # grad is dead from here on, so its scratch can hold the denominator (sqrt into `out=` then
    # in-place div_/add_ runs the same kernels as torch's `v.sqrt() / x` and `.add_(eps)`).
    if scratch is not None:
        denom = torch.sqrt(v, out=scratch).div_(bias_correction2_sqrt).add_(cfg.eps)
    else:
        denom = (v.sqrt() / bias_correction2_sqrt).add_(cfg.eps)
    p.addcdiv_(m, denom, value=-step_size)


_warm = False


def warm_cpu_math() -> None:
    """Run the CPU AdamW's `sqrt` once, split over every intra-op thread, before a process's
    first real update.

    Why: torch's CPU sqrt is MKL VML's (not IEEE: 21 of 4096 values differ from the correctly
    rounded ones) and a 4096-element call is split between the intra-op threads.  In a fresh
    process the first such call did not always compute its second half the way every later call
    does (a few ulps in the denominator).  A fault-free run meets that call at step 0, a promoted
    or recovering trainer on the chunk it redoes, so a recovered CPU run differed from the
    fault-free one in half a chunk of parameters (tests/integration/test_rmu_crash.py, about
    one module run in two in CI's environment, 2026-11-29 .. 11-30; none in 5 runs with this
    warm-up).  Idempotent; CPU only (the GPU path uses Leto's own kernels)."""
    global _warm
    if _warm:
        return
    n = 4096 * max(1, torch.get_num_threads())
    v = torch.linspace(1e-8, 1.0, n)
    for _ in range(2):
        torch.sqrt(v).div_(0.5).add_(1e-8)
    _warm = True
