"""What the runtime requires of, and does to, a model's modules apart from the retained views.

Role: the structural checks and conversions of `Job.meta_init` / `Job.retain`:

* `meta_params()` — build a model with its *parameters* on the meta device (no memory, no
  values: `retain(init=...)` writes them once, in retained memory) while everything else
  `__init__` computes stays real: a constant buffer (rotary frequencies, a causal mask) keeps
  the values the script's own code gave it, as under torchrun.
* `materialize_buffers(model, device)` — buffers left on the meta device get real memory one
  by one (for `retain(buffers=fn)` to fill), real ones move to the job's device; parameters are
  never touched (`Module.to_empty` would give them fresh storage and detach them from
  retained memory).
* `refuse_frozen(model)`, `refuse_dtypes(model)` — what `job.adamw` / `retain` refuse, with the fix.
* `ddp_problem(ddp, inplace, world_size)` — what makes a DDP over the model inexact.
* `refuse_mutating(model)` and `BufferWatch` — buffers are not retained, so a buffer that
  forward changes (BatchNorm's running statistics) would be lost by a recovery: modules known
  to do it are refused at `retain()`, and the watch checks at the first steps of every process
  that no buffer changed, stopping with the buffer's name otherwise.

Calling contract: pure functions over `torch.nn.Module`s, no processes, no I/O; errors are
`ValueError`s whose text names the offending module or parameter and the fix.
"""
from __future__ import annotations

import contextlib

import torch

from leto_runtime.errors import PortingError

WATCH_STEPS = 2     # steps of each process at which the buffers are compared


@contextlib.contextmanager
def meta_params():
    """Parameters registered meanwhile go to the meta device (requires_grad kept); the
    `torch.nn.init` functions do nothing, since the values are written later by `retain`."""
    import torch.nn.init as I
    saved = {n: getattr(I, n) for n in dir(I)
             if n.endswith("_") and not n.startswith("_") and callable(getattr(I, n))}
    register = torch.nn.Module.register_parameter

    def skip(tensor, *args, **kwargs):
        return tensor

    def register_meta(mod, name, param):
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(torch.empty_like(param, device="meta"),
                                       requires_grad=param.requires_grad)
        register(mod, name, param)

    for n in saved:
        setattr(I, n, skip)
    torch.nn.Module.register_parameter = register_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register
        for n, f in saved.items():
            setattr(I, n, f)


def placeholders(model: torch.nn.Module, device) -> None:
    """Meta parameters (or ones on another device) become placeholders on `device`: the
    same Parameter objects (`torch.utils.swap_tensors`: ties and the script's references
    hold) over one zero element, until the states are bound.  No memory; any write into one
    before then fails loudly instead of landing somewhere."""
    device = torch.device(device)
    seen = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.is_meta or p.device != device:
            ph = torch.nn.Parameter(torch.zeros(1, dtype=p.dtype, device=device).expand(p.shape),
                                    requires_grad=p.requires_grad)
            torch.utils.swap_tensors(p, ph)


def meta_buffers(model: torch.nn.Module) -> list[str]:
    return [n for n, b in model.named_buffers() if b.is_meta]


def materialize_buffers(model: torch.nn.Module, device) -> None:
    """Meta buffers get real, uninitialized memory on `device`; real ones move there."""
    device = torch.device(device)
    for mod in model.modules():
        for name, b in list(mod._buffers.items()):
            if b is None:
                continue
            if b.is_meta:
                mod._buffers[name] = torch.empty_like(b, device=device)
            elif b.device != device:
                mod._buffers[name] = b.to(device)


def refuse_frozen(model: torch.nn.Module) -> None:
    """Frozen parameters would still be moved by the update (weight decay) and are not kept
    apart in retained memory: refused, with the fix, rather than training something other
    than what the script says."""
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        raise PortingError(f"frozen parameters (requires_grad=False) are not supported by "
                         f"leto_runtime yet: {', '.join(frozen[:4])}"
                         f"{' ...' if len(frozen) > 4 else ''}; keep frozen modules outside "
                         "the model given to retain(), or train them")


def refuse_dtypes(model: torch.nn.Module) -> None:
    """The retained parameters are float32 (fp32 master state; bf16 compute goes through
    `job.autocast()`)."""
    bad = [f"{n} ({p.dtype})" for n, p in model.named_parameters() if p.dtype != torch.float32]
    if bad:
        raise PortingError(f"parameters {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''} are "
                         "not float32: leto_runtime retains float32 parameters (build the model "
                         "in float32 and compute in bf16 under job.autocast())")


def refuse_mutating(model: torch.nn.Module) -> None:
    """Modules whose forward updates their own buffers (in training mode)."""
    from torch.nn.modules.batchnorm import _NormBase
    bad = [n or type(model).__name__ for n, m in model.named_modules()
           if isinstance(m, _NormBase) and m.track_running_stats]
    if bad:
        raise PortingError(f"{', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}: batch-norm "
                         "running statistics are buffers that forward changes, and buffers are "
                         "not retained (a recovery would lose them); build these modules with "
                         "track_running_stats=False, or use LayerNorm/GroupNorm")


class BufferWatch:
    """Copies of every buffer, compared after the first `WATCH_STEPS` steps a process runs:
    a buffer that changed is one that recovery would not restore."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.saved = {n: b.detach().clone() for n, b in model.named_buffers()}
        self.left = WATCH_STEPS if self.saved else 0

    def check(self, step: int) -> None:
        if self.left <= 0:
            return
        self.left -= 1
        for n, b in self.model.named_buffers():
            ref = self.saved.get(n)
            if ref is None or ref.shape != b.shape or not torch.equal(ref, b.detach()):
                raise PortingError(f"buffer {n!r} changed during step {step}: buffers are not "
                                 "retained, so a recovery would not restore it; only constant "
                                 "buffers are supported (for state that forward updates, keep it "
                                 "out of the model's buffers)")
        if self.left == 0:
            self.saved = {}


def ddp_rebuild_pending(ddp) -> bool:
    """DDP will still rebuild its gradient buckets (in the pre-forward of its second iteration:
    without find_unused_parameters, or with a static graph), allocating them then.  Pure."""
    rebuilds = bool(getattr(ddp, "static_graph", False)) or not ddp.find_unused_parameters
    return rebuilds and not getattr(ddp, "_has_rebuilt_buckets", False)


def ddp_problem(ddp, inplace: bool, world_size: int) -> str | None:
    """Why a DistributedDataParallel over the retained model cannot be recovered exactly
    (None: it can).  Pure: reads the DDP object's settings."""
    if ddp.gradient_as_bucket_view:
        return ("DistributedDataParallel(gradient_as_bucket_view=True) makes the gradients "
                "views of DDP's buckets, not of retained memory: build it with "
                "gradient_as_bucket_view=False (the default)")
    if inplace and world_size > 2 and not ddp.find_unused_parameters:
        return ("DistributedDataParallel rebuilds its gradient buckets after its first "
                "iteration, and a trainer that recovers starts a new DDP whose first step uses "
                "the initial buckets: on 3+ ranks the all-reduce then sums in another order "
                "and the bits differ from the run without failures. Build it with "
                "find_unused_parameters=True (the buckets are never rebuilt)")
    return None
