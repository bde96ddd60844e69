"""The fused CUDA AdamW chunk kernel (cuda/adamw_cuda.cu): one pass instead of ~10 torch kernels.

Role: the CUDA fast path of `adamw.adamw_chunk_`.  One kernel reads p, m, v, g (and the clip
coefficient from device memory), writes the new p, m, v and, when asked, each state's delta
pages old ^ new for the parity update -- so the update moves 28 bytes per parameter (+12 for the
deltas) instead of ~90 through ten element-wise kernels and a separate XOR pass.

Exactness: the kernel spells every operation the way the ATen CUDA kernel it replaces does (see
the .cu file), so it is meant to be bit-identical to `adamw_chunk_` on the same device.  Meant is
not proven: `Fused.for_device` runs a self-check on first use in the process -- random states
over the whole float range of interest, two steps, with and without clipping and decay --
against `adamw_chunk_` and returns None (the updater then keeps the torch ops) on any bit of
difference, with the reason in `fused.why_not`.  The kernel has spellings (variants) for the
ops whose compiled form torch does not document (FMA or not, reciprocal or true division); the
first variant that passes is the one used.  tests/gpu/test_rmu_fused_gpu.py asserts the
kernel equal to `torch.optim.AdamW(foreach=False)` itself.

Calling contract: `Fused.for_device(device, cfg)` -> a `Fused` or None; then
`f.step_(p, m, v, g, step=, lr=, coef=, deltas=)` queues the update on the current stream
(no synchronization).  LETO_RMU_FUSED=0 turns the fast path off; LETO_RMU_FUSED_VARIANT=N
checks and uses only spelling N (cross-checks).
"""
from __future__ import annotations

import logging
import os
from typing import Optional, Sequence

import torch

from leto_runtime.rmu import adamw as A

log = logging.getLogger("leto.rmu")

_cache: dict = {}
why_not: str = ""


def wanted() -> bool:
    return os.environ.get("LETO_RMU_FUSED", "1") != "0"


def load():
    """The compiled extension (JIT-built like the parity kernels; raises ParityBackendUnavailable).
    It also carries the marker's stream-ordered writes (cuda/marker_stream.cpp, `Marker.use_stream`)."""
    from leto_runtime.parity import _ext

    def build():
        import torch.utils.cpp_extension as cpp

        from leto_runtime.parity.errors import ParityBackendUnavailable
        if torch.version.cuda is None or cpp.CUDA_HOME is None or not torch.cuda.is_available():
            raise ParityBackendUnavailable("cuda", "no CUDA torch, nvcc or device", "run on a GPU machine")
        src = _ext.source_dir()
        return _ext._load("leto_rmu_cuda", [str(src / "adamw_cuda.cu"), str(src / "adamw_binding.cpp"),
                                             str(src / "marker_stream.cpp")],
                          cuda=True)

    return _ext._cached("rmu_cuda", build)


class Fused:
    """The kernel bound to one AdamW configuration and one spelling (`variant`) of torch's ops."""

    def __init__(self, ext, cfg: "A.AdamWConfig", variant: int = 0):
        self.ext, self.cfg, self.variant = ext, cfg, variant

    @classmethod
    def for_device(cls, device, cfg: "A.AdamWConfig") -> Optional["Fused"]:
        """The fast path for `device` if it is CUDA, wanted, builds, and passes the self-check."""
        global why_not
        device = torch.device(device)
        if device.type != "cuda" or not wanted():
            why_not = "not a CUDA device" if device.type != "cuda" else "LETO_RMU_FUSED=0"
            return None
        key = (str(device), cfg)
        if key not in _cache:
            f, bad = None, ""
            try:
                ext = load()
                env = os.environ.get("LETO_RMU_FUSED_VARIANT")
                # The kernel's spellings of torch's ops (adamw_cuda.cu); the first one whose bits
                # equal adamw_chunk_'s on this device is used.  A formula that rounds differently
                # anywhere differs in a large share of the ~3M checked updates (H200: >= 500).
                order = [int(env)] if env else [0, 8, *[v for v in range(16) if v not in (0, 8)]]
                fails = []
                for v in order:
                    why = cls(ext, cfg, v).self_check(device)
                    if not why:
                        f = cls(ext, cfg, v)
                        break
                    fails.append(why)
                if f is None:
                    bad = "no kernel variant matches adamw_chunk_ bit for bit: " + "; ".join(fails[:2])
            except Exception as e:          # build failure: keep the torch ops, say why
                bad = f"{type(e).__name__}: {e}"
            if bad:
                log.warning("leto.rmu: fused AdamW kernel not used: %s", bad)
            why_not = bad
            _cache[key] = f
        return _cache[key]

    def step_(self, p, m, v, g, *, step: int, lr: float, coef: Optional[torch.Tensor],
              deltas: Optional[Sequence[torch.Tensor]] = None) -> None:
        """adamw_chunk_(p, m, v, g, step=, lr=, cfg=, coef=) in one kernel; with `deltas`
        (3 tensors of len(p) * 4 bytes) also writes old ^ new of p, m, v there."""
        cfg = self.cfg
        beta1, beta2 = cfg.betas
        lr = float(lr)
        s = float(step)
        bc1 = 1 - beta1 ** s
        bc2 = 1 - beta2 ** s
        self.ext.adamw_fused(p, m, v, g, None if coef is None else coef.reshape(1),
                             None if deltas is None else list(deltas),
                             1 - lr * cfg.weight_decay, beta1, beta2, cfg.eps, bc2 ** 0.5, lr / bc1,
                             cfg.weight_decay != 0, self.variant)

    def self_check(self, device, n: int = 1 << 18) -> str:
        """'' when the kernel gives adamw_chunk_'s bits on `device`, else what differed.

        This job's hyper-parameters with clipping on and off, plus beta2 = 0.999 and 0.99 (whose
        bias corrections tell the float and double reciprocals apart), at steps 1, 2 and 7, on
        values spread over 15 decades."""
        from dataclasses import replace

        gen = torch.Generator(device="cpu").manual_seed(0x1E70)
        scale = torch.logspace(-12, 3, n, dtype=torch.float64)[torch.randperm(n, generator=gen)].float()
        c0 = self.cfg
        cfgs = [replace(c0, clip_grad_norm=1.0), replace(c0, clip_grad_norm=None),
                replace(c0, betas=(c0.betas[0], 0.999), clip_grad_norm=1.0),
                replace(c0, betas=(c0.betas[0], 0.99), clip_grad_norm=None, weight_decay=0.0)]
        for cfg in cfgs:
            clip = cfg.clip_grad_norm is not None
            ref = [torch.randn(n, generator=gen) * scale for _ in range(2)]
            ref.append(torch.rand(n, generator=gen) * scale * scale)
            ref = [t.to(device) for t in ref]
            mine = [t.clone() for t in ref]
            coef = torch.tensor(0.37, device=device) if clip else None
            f = Fused(self.ext, cfg, self.variant)
            for step, lr in ((1, cfg.lr * 0.5), (2, cfg.lr), (7, cfg.lr)):
                g = (torch.randn(n, generator=gen) * scale).to(device)
                A.adamw_chunk_(*ref, g, step=step, lr=lr, cfg=cfg, coef=coef)
                olds = [t.clone() for t in mine]
                d = [torch.empty(n, dtype=torch.int32, device=device) for _ in range(3)]
                f.step_(*mine, g, step=step, lr=lr, coef=coef, deltas=d)
                diff = {name: int((r.view(torch.int32) != x.view(torch.int32)).sum())
                        for name, r, x in zip(("params", "exp_avg", "exp_avg_sq"), ref, mine)}
                if any(diff.values()):
                    return (f"variant {self.variant}: differs from adamw_chunk_ in {diff} of {n} "
                            f"elements (step {step}, betas {cfg.betas}, clip {clip})")
                for name, o, x, dd in zip(("params", "exp_avg", "exp_avg_sq"), olds, mine, d):
                    if not torch.equal(dd, o.view(torch.int32) ^ x.view(torch.int32)):
                        return f"variant {self.variant}: the {name} delta is not old ^ new"
        return ""
