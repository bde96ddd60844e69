"""Chunked optimizer math for the Resumable Model Updater: torch's Adam, AdamW and SGD, one chunk
at a time.

Role: the arithmetic of one parameter group's update, for any of the stock optimizers Leto takes
over (`leto_runtime.torch_optim` reads them into `Hyper` values).  `adamw.adamw_chunk_` is the
AdamW-only original with its own config; this module generalizes it to one `Hyper` per parameter
group.  Pure functions of their arguments: no processes, no I/O, no global state, torch ops only
(CPU and CUDA tensors alike).

Calling contract, one iteration of a data-parallel job (`step` is 1-based: iteration t uses t+1):

    adamw.warm_cpu_math()     # on CPU, once per process: the same MKL sqrt as adamw_chunk_'s
    coef = None or adamw.clip_coef(adamw.total_norm_from_sq(sq), max_norm)   # as in adamw.py
    for each parameter group i, with h = hypers[i] (h.n_states state tensors per parameter):
        for each chunk (p, states, g) of that group's flat params, states and grads:
            update_chunk_(h, p, states, g, step=step, coef=coef, scratch=buf)

Exactness guarantees (asserted by tests/unit/test_rmu_chunk_math.py):
  * bitwise equal to torch.optim.{Adam, AdamW, SGD}(..., foreach=False, fused=False) stepping
    parameters whose `.grad` is `g * coef` (clip_grad_norm_(foreach=False) already applied):
    the same ops in the same order with the same Python scalars as torch's single-tensor
    implementations (`_single_tensor_adam`, `_single_tensor_sgd`) on the same device;
  * position independent: any split of a tensor into chunks gives the bits of the whole-tensor
    update (every op is element-wise and computes one formula per element on the DEFAULT, AVX2
    and AVX512 CPU kernels alike);
  * `g` is never written, so an interrupted chunk restored from its undo copy redoes exactly.

Not bitwise across devices or CPU ISAs: e.g. `add(x, alpha=a)` is one fused multiply-add per
element on AVX2/AVX512 but two roundings on DEFAULT.  A job resumes on the kind of device it ran on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

__all__ = ["Hyper", "KINDS", "adam_chunk_", "sgd_chunk_", "update_chunk_"]

KINDS = ("adamw", "adam", "sgd")
_ADAM_FIELDS = ("beta1", "beta2", "eps")
_SGD_FIELDS = ("momentum", "dampening", "nesterov")
F32_STEP_LIMIT = 2**24     # the last integer a float32 step counter reaches by adding 1


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class Hyper:
    """One parameter group's hyper-parameters for one step, as torch's param_groups hold them.

    kind:         "adamw" (decoupled decay p *= 1 - lr*wd), "adam" (L2: grad += wd * p), "sgd".
    lr:           learning rate (>= 0: schedulers may set 0, e.g. at the first warmup step).
    weight_decay: >= 0; maximize: ascend instead of descend (torch negates the gradient).
    beta1, beta2, eps: adam/adamw only (betas in [0, 1), eps >= 0).
    momentum, dampening, nesterov: sgd only (momentum >= 0; nesterov needs momentum > 0 and
                  dampening == 0, as torch.optim.SGD says).
    The fields of the other kind must keep their defaults, so two equal groups compare equal.
    Frozen: the values of a step cannot drift between a run and its redo.
    """

    kind: str
    lr: float
    weight_decay: float = 0.0
    maximize: bool = False
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False

    def __post_init__(self):
        def bad(field: str, fix: str):
            raise ValueError(f"Hyper.{field}={getattr(self, field)!r}: {fix}")

        if self.kind not in KINDS:
            bad("kind", f"must be one of {', '.join(map(repr, KINDS))}")
        for name in ("lr", "weight_decay", "beta1", "beta2", "eps", "momentum", "dampening"):
            x = getattr(self, name)
            if not _is_real(x) or not math.isfinite(x):
                bad(name, "must be a finite Python number (a Tensor value is not supported)")
            object.__setattr__(self, name, float(x))  # plain floats: exact JSON, stable hash
        for name in ("maximize", "nesterov"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a bool")
        if self.lr < 0:
            bad("lr", "must be >= 0")
        if self.weight_decay < 0:
            bad("weight_decay", "must be >= 0 (0 disables decay)")
        other = _SGD_FIELDS if self.kind != "sgd" else _ADAM_FIELDS
        for f in fields(self):
            if f.name in other and getattr(self, f.name) != f.default:
                bad(f.name, f"is not a field of kind {self.kind!r}; leave it at its default {f.default!r}")
        if self.kind == "sgd":
            if self.momentum < 0:
                bad("momentum", "must be >= 0 (0 disables the momentum buffer)")
            if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
                bad("nesterov", "Nesterov momentum requires a momentum > 0 and zero dampening")
        else:
            for name in ("beta1", "beta2"):
                if not 0.0 <= getattr(self, name) < 1.0:
                    bad(name, "must be in [0, 1)")
            if self.eps < 0:
                bad("eps", "must be >= 0")

    @property
    def n_states(self) -> int:
        """Optimizer state tensors per parameter besides the parameter itself."""
        return len(self.state_names)

    @property
    def state_names(self) -> tuple[str, ...]:
        """torch's state keys, in the order update_chunk_ takes the states."""
        if self.kind != "sgd":
            return ("exp_avg", "exp_avg_sq")
        return ("momentum_buffer",) if self.momentum != 0 else ()

    def to_json(self) -> dict:
        """Plain Python values (the kind's own fields only); json's float repr round-trips exactly."""
        skip = _SGD_FIELDS if self.kind != "sgd" else _ADAM_FIELDS
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}

    @classmethod
    def from_json(cls, d: dict) -> "Hyper":
        if not isinstance(d, dict):
            raise ValueError(f"Hyper.from_json: expected a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"Hyper.from_json: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**d)


def _check(fn: str, n: int, device, **tensors) -> None:
    for name, t in tensors.items():
        if (not isinstance(t, Tensor) or t.dim() != 1 or t.dtype != torch.float32
                or t.numel() != n or t.device != device):
            got = (f"shape {tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, Tensor)
                   else type(t).__name__)
            raise ValueError(f"{fn}: {name} must be a 1-D float32 tensor of {n} elements on "
                             f"{device}, got {got}")


def _check_common(fn: str, p: Tensor, h: Hyper, coef, scratch) -> Tensor | None:
    """Validate coef and scratch; return scratch cut to len(p) (or None)."""
    if not isinstance(h, Hyper):
        raise ValueError(f"{fn}: h must be a Hyper, got {type(h).__name__}")
    if coef is not None and (not isinstance(coef, Tensor) or coef.dim() != 0
                             or coef.dtype != torch.float32 or coef.device != p.device):
        got = (f"shape {tuple(coef.shape)} {coef.dtype} on {coef.device}"
               if isinstance(coef, Tensor) else type(coef).__name__)
        raise ValueError(f"{fn}: coef must be None or a 0-dim float32 tensor on {p.device} "
                         f"(adamw.clip_coef), got {got}")
    if scratch is None:
        return None
    n = p.numel()
    if (not isinstance(scratch, Tensor) or scratch.dim() != 1 or scratch.dtype != torch.float32
            or scratch.numel() < n or scratch.device != p.device):
        got = (f"shape {tuple(scratch.shape)} {scratch.dtype} on {scratch.device}"
               if isinstance(scratch, Tensor) else type(scratch).__name__)
        raise ValueError(f"{fn}: scratch must be a 1-D float32 tensor of >= {n} elements on "
                         f"{p.device}, got {got}")
    return scratch[:n]


def _grad(p: Tensor, g: Tensor, h: Hyper, coef, scratch, l2: bool) -> Tensor:
    """The gradient torch's step works with: g * coef (clip_grad_norm_), negated for maximize,
    plus wd * p when `l2`.  Each op is torch's own (out= or in place runs the same kernel as the
    out-of-place spelling).  Never writes g: the first op that changes a value writes a new
    tensor or scratch.  Returns g itself when nothing applies."""
    grad = g
    if coef is not None:
        grad = torch.mul(g, coef, out=scratch) if scratch is not None else g * coef
    if h.maximize:
        grad = torch.neg(grad, out=scratch) if scratch is not None else -grad
    if l2 and h.weight_decay != 0:
        if scratch is not None:
            grad = torch.add(grad, p, alpha=h.weight_decay, out=scratch)
        else:
            grad = grad.add(p, alpha=h.weight_decay)
    return grad


def adam_chunk_(p: Tensor, m: Tensor, v: Tensor, g: Tensor, *, step: int, h: Hyper,
                coef: Tensor | None, scratch: Tensor | None = None) -> None:
    """In-place Adam (h.kind "adam") or AdamW ("adamw") update of one chunk.

    p, m, v, g: 1-D float32 tensors of equal length on one device: parameters, exp_avg,
        exp_avg_sq (updated in place) and gradients (read only, never written).
    step:   1-based Adam step (bias correction).  torch keeps one per parameter
        (state["step"]), counted only on steps where that parameter had a gradient.
    coef:   clip coefficient (0-dim float32 on the chunk's device, adamw.clip_coef) or None.
    scratch: optional 1-D float32 buffer of >= len(p) elements on the same device.  Its first
        len(p) elements hold the working gradient (g * coef, negated for maximize, + wd * p for
        "adam"), then the denominator, so the update allocates nothing.  Without it,
        temporaries of the chunk's size are allocated (as torch does).

    _single_tensor_adam (amsgrad=False, capturable=False, differentiable=False), op for op:
        grad   = g * coef; grad = -grad (maximize); grad = grad.add(p, alpha=wd) ("adam")
        p     *= 1 - lr * wd                                ("adamw", wd != 0)
        m.lerp_(grad, 1 - beta1);  v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bc1 = 1 - beta1 ** s;  bc2 = 1 - beta2 ** s         (doubles, s = float(min(step, 2**24)))
        denom = (sqrt(v) / bc2 ** 0.5).add_(eps);  p.addcdiv_(m, denom, value=-(lr / bc1))
    """
    n = p.numel()
    _check("adam_chunk_", n, p.device, p=p, m=m, v=v, g=g)
    scratch = _check_common("adam_chunk_", p, h, coef, scratch)
    if h.kind not in ("adam", "adamw"):
        raise ValueError(f"adam_chunk_: h.kind={h.kind!r}; use sgd_chunk_ or update_chunk_")
    if not _is_int(step) or step < 1:
        raise ValueError(f"adam_chunk_: step={step!r} must be the 1-based Adam step (int >= 1)")
    lr, wd = h.lr, h.weight_decay

    # torch negates before decaying, and decays p before the moments (grad already holds old p).
    grad = _grad(p, g, h, coef, scratch, l2=h.kind == "adam")
    if h.kind == "adamw" and wd != 0:
        p.mul_(1 - lr * wd)
    m.lerp_(grad, 1 - h.beta1)
    v.mul_(h.beta2).addcmul_(grad, grad, value=1 - h.beta2)

    # torch counts steps in a float32 tensor (`step_t += 1`, read back with `.item()`), which
    # stops at 2**24: 2**24 + 1 rounds back to 2**24.  The same float here, at any step.
    s = float(min(step, F32_STEP_LIMIT))
    bias_correction1 = 1 - h.beta1 ** s
    bias_correction2 = 1 - h.beta2 ** s
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5

    # grad is dead from here on, so its scratch can hold the denominator.
    if scratch is not None:
        denom = torch.sqrt(v, out=scratch).div_(bias_correction2_sqrt).add_(h.eps)
    else:
        denom = (v.sqrt() / bias_correction2_sqrt).add_(h.eps)
    p.addcdiv_(m, denom, value=-step_size)


def sgd_chunk_(p: Tensor, buf: Tensor | None, g: Tensor, *, first: bool, h: Hyper,
               coef: Tensor | None, scratch: Tensor | None = None) -> None:
    """In-place SGD update of one chunk.

    p, g:   1-D float32 tensors of equal length on one device: parameters (updated in place)
        and gradients (read only, never written).
    buf:    the momentum buffer (same shape, updated in place), or None when h.momentum == 0.
    first:  True on the group's first step (torch's `momentum_buffer is None`): the buffer is
        then overwritten with the gradient (its old contents are ignored), not decayed.
    coef:   clip coefficient (0-dim float32 on the chunk's device) or None.
    scratch: optional 1-D float32 buffer of >= len(p) elements on the same device; its first
        len(p) elements hold the working gradient (g * coef, negated for maximize, + wd * p,
        + momentum * buf for nesterov), so the update allocates nothing.

    _single_tensor_sgd (float lr, float weight_decay), op for op:
        grad = g * coef; grad = -grad (maximize); grad = grad.add(p, alpha=wd) (wd != 0)
        momentum != 0:  first: buf = grad (copy_: clone's bits)
                        else:  buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                        grad = grad.add(buf, alpha=momentum) if nesterov else buf
        p.add_(grad, alpha=-lr)
    """
    n = p.numel()
    _check("sgd_chunk_", n, p.device, p=p, g=g)
    scratch = _check_common("sgd_chunk_", p, h, coef, scratch)
    if h.kind != "sgd":
        raise ValueError(f"sgd_chunk_: h.kind={h.kind!r}; use adam_chunk_ or update_chunk_")
    if not isinstance(first, bool):
        raise ValueError(f"sgd_chunk_: first={first!r} must be a bool")
    if h.momentum == 0:
        if buf is not None:
            raise ValueError("sgd_chunk_: buf must be None when h.momentum == 0 (no momentum buffer)")
    else:
        if buf is None:
            raise ValueError(f"sgd_chunk_: buf is None but h.momentum={h.momentum}; pass the "
                             "momentum buffer")
        _check("sgd_chunk_", n, p.device, buf=buf)

    grad = _grad(p, g, h, coef, scratch, l2=True)
    if h.momentum != 0:
        if first:
            buf.copy_(grad)
        else:
            buf.mul_(h.momentum).add_(grad, alpha=1 - h.dampening)
        if h.nesterov:
            grad = (torch.add(grad, buf, alpha=h.momentum, out=scratch) if scratch is not None
                    else grad.add(buf, alpha=h.momentum))
        else:
            grad = buf
    p.add_(grad, alpha=-h.lr)


def update_chunk_(h: Hyper, p: Tensor, states: tuple, g: Tensor, *, step: int,
                  coef: Tensor | None, scratch: Tensor | None = None) -> None:
    """Update one chunk of a group of kind h.kind: states are (exp_avg, exp_avg_sq) for
    adam/adamw, (momentum_buffer,) for sgd with momentum, () for plain sgd (h.state_names).
    step is 1-based and per parameter, like torch's (a parameter without a gradient is not
    stepped); for sgd, step 1 is the first step (the momentum buffer is initialized)."""
    if not isinstance(h, Hyper):
        raise ValueError(f"update_chunk_: h must be a Hyper, got {type(h).__name__}")
    states = tuple(states)
    if len(states) != h.n_states:
        raise ValueError(f"update_chunk_: kind {h.kind!r} takes {h.n_states} state tensor(s) "
                         f"{h.state_names}, got {len(states)}")
    if not _is_int(step) or step < 1:
        raise ValueError(f"update_chunk_: step={step!r} must be the 1-based step (int >= 1)")
    if h.kind == "sgd":
        buf = states[0] if states else None
        sgd_chunk_(p, buf, g, first=step == 1, h=h, coef=coef, scratch=scratch)
    else:
        adam_chunk_(p, states[0], states[1], g, step=step, h=h, coef=coef, scratch=scratch)
