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

One step further (cuda/adamw_syndrome.cu): `chunk_syndrome_` does a chunk's AdamW *and* the
parity delta of its three states in one kernel, reading the old values from the undo copy and
never writing the delta pages (docs/RMU.md, "The parity delta update").  It is taken wherever its own self-check
(`syndrome_check`: the same bits as `step_` with deltas followed by
`ParityCode.update_delta_many`, new states and parity pages, baked and run-time mix) passes on
the device, unless LETO_RMU_FUSED_SYNDROME=0 (it is the faster of the two on the H200:
docs/BENCHMARKS.md).

Calling contract: `Fused.for_device(device, cfg)` (or `for_group(device, hyper, clip)` for one
parameter group of a torch optimizer) -> a `Fused` or None; then
`f.step_(p, m, v, g, step=, lr=, coef=, deltas=)` queues the update on the current stream
(no synchronization); `f.syndrome_ok(device)` -> bool, then `f.chunk_syndrome_(...)`.
LETO_RMU_FUSED=0 turns the fast path off; LETO_RMU_FUSED_VARIANT=N checks and uses only
spelling N (cross-checks); LETO_RMU_FUSED_LAYOUT=NAME picks the one-kernel chunk's tiling and
grid order (`LAYOUTS`; a name not in it raises `LayoutError`).
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from leto_runtime.wire import settings
from leto_runtime.rmu import adamw as A
from leto_runtime.rmu import fold as FD

log = logging.getLogger("leto.rmu")

_cache: dict = {}
why_not: str = ""
why_not_syndrome: str = ""
why_not_fold: str = ""


def wanted() -> bool:
    return settings.get().rmu_fused


# The one-kernel chunk's tiling and grid order (cuda/adamw_syndrome.cu, its `layout` argument):
# all give the same bits -- each is self-checked against the two-kernel path before use -- and
# which is fastest is measured (benchmarks/rmu_overhead.py, the rmu_f* variants).
LAYOUT_ENV = "LETO_RMU_FUSED_LAYOUT"
# "ws": cuda/adamw_ws.cu, one warp-specialized CTA per 2 KiB tile for the three states (the
# updater's chunk through the same binding; adamw_syndrome.cu dispatches to it).
LAYOUTS = {"4x2x3": 0, "4x2x3-statemajor": 1, "2x2x3": 2, "2x2x3-statemajor": 3, "ws": 4}
# "auto": ws, or 4x2x3 where ws fails its self-check on the device (e.g. a GPU whose shared
# memory per block is below ws's ~101 KiB); a named layout has no fallback.
AUTO = "auto"
AUTO_ORDER = (4, 0)


def _name(lay: int) -> str:
    return next(n for n, i in LAYOUTS.items() if i == lay)


class LayoutError(ValueError):
    """LETO_RMU_FUSED_LAYOUT names no layout of the kernel."""


def layouts() -> tuple[int, ...]:
    """The layouts to self-check, in order of preference: the one named, or AUTO_ORDER."""
    name = settings.get().rmu_fused_layout
    if name == AUTO:
        return AUTO_ORDER
    if name not in LAYOUTS:
        raise LayoutError(f"{LAYOUT_ENV}={name!r} is not a layout of the AdamW + parity kernel "
                          f"(cuda/adamw_syndrome.cu): use one of {', '.join(LAYOUTS)}, or unset it "
                          f"for the default 4x2x3 ({AUTO}: ws, else 4x2x3)")
    return (LAYOUTS[name],)


def layout() -> int:
    """The preferred layout (before the device's self-check picks among `layouts()`)."""
    return layouts()[0]


def _cuda_ext(key: str, name: str, sources: list[str], what: str):
    """A CUDA extension of cuda/, JIT-built into the kernel cache on first use, once per process
    (raises ParityBackendUnavailable without a CUDA torch, nvcc or device)."""
    from leto_runtime.parity import _ext

    def build():
        import torch.utils.cpp_extension as cpp

        from leto_runtime.parity.errors import ParityBackendUnavailable
        if torch.version.cuda is None or cpp.CUDA_HOME is None or not torch.cuda.is_available():
            raise ParityBackendUnavailable("cuda", "no CUDA torch, nvcc or device", "run on a GPU machine")
        return _ext._load(name, sources, cuda=True, what=what)

    return _ext._cached(key, build)


def load():
    """The compiled extension (JIT-built into the kernel cache like the parity kernels, on first
    use; raises ParityBackendUnavailable).
    It also carries the marker's stream-ordered writes (cuda/marker_stream.cpp, `Marker.use_stream`)."""
    return _cuda_ext("rmu_cuda", "leto_rmu_cuda", ["adamw_cuda.cu", "adamw_syndrome.cu", "adamw_ws.cu",
                                                    "adamw_binding.cpp", "marker_stream.cpp", "marker_kernel.cu"],
                     "the fused AdamW and marker kernels")


# The benchmarks' chunk kernels (`Fused.chunk_bench_`; extension `load_fold`): the alternatives
# to the undo copy + adamw_syndrome.cu that benchmarks/rmu_kernel_bench.py measures.
BENCH_KERNELS = {
    "fold": "cuda/adamw_fold.cu: the undo copy folded in, the 3 CTAs of a tile a cluster",
    "fold+counts": "the same with per-tile stage counts ordering undo and in-place stores",
    "onecta": "cuda/adamw_onecta.cu: one CTA per 2 KiB tile for the 3 states, reads the undo copy",
    "onecta-fold": "the same with the undo copy folded in (states read in place)",
    "ws-fold": "cuda/adamw_ws.cu (the layout \"ws\") with the undo copy folded in (states read in place)",
    "ws-fold+counts": "the same with per-unit stage counts: the updater's folded chunk (LETO_RMU_FOLD=1, rmu/fold.py)",
    "ws-fold+counts/2": "the same counting every 2 stages (a fence per 2 stages; cuda/adamw_ws_bench.cu)",
    "ws-fold+counts/4": "the same counting every 4 stages",
}
# Those that read the undo copy made beforehand (the others write it).
BENCH_READS_UNDO = ("onecta",)


def load_fold():
    """The benchmarks' chunk kernels (cuda/adamw_fold.cu, adamw_onecta.cu, adamw_ws.cu; their own extension:
    the updater does not use them, so `leto-run --build-kernels` does not build it; JIT-built
    on first use)."""
    return _cuda_ext("rmu_fold", "leto_rmu_fold", ["adamw_fold.cu", "adamw_onecta.cu", "adamw_ws_bench.cu",
                                                     "adamw_fold_binding.cpp"],
                     "the benchmarks' chunk kernels")


def fold_stages(pages: int) -> int:
    """The 2-page stages of a fold chunk of `pages` pages (cuda/adamw_fold.cu): stage s holds
    pages P-1-2s and P-2-2s of P = pages rounded up to 16 (those < pages)."""
    return ((pages + 15) // 16 * 16) // 2


def for_group(device, h, clip: Optional[float]) -> Optional["Fused"]:
    """The fused kernel for one parameter group of a plan (rmu/plan.py), or None when the group
    takes torch ops: a kind other than torch's AdamW, `maximize`, eps = 0 (no AdamWConfig), or
    no kernel passing its self-check on `device`.  The learning rate is passed per launch, so the
    check and the cache key use a fixed one."""
    if h.kind != "adamw" or h.maximize or h.eps <= 0:
        return None
    # Asked for every piece of every chunk: the config is built (and validated) once per values.
    key = ("group", str(device), h.beta1, h.beta2, h.eps, h.weight_decay, clip)
    if key not in _cache:
        cfg = A.AdamWConfig(lr=1e-3, betas=(h.beta1, h.beta2), eps=h.eps,
                            weight_decay=h.weight_decay, clip_grad_norm=clip)
        _cache[key] = Fused.for_device(device, cfg)
    return _cache[key]


class Fused:
    """The kernel bound to one AdamW configuration and one spelling (`variant`) of torch's ops."""

    def __init__(self, ext, cfg: "A.AdamWConfig", variant: int = 0):
        self.ext, self.cfg, self.variant = ext, cfg, variant
        self.layout = layout()
        self.candidates = layouts()
        # the folded chunk's stages per count (LETO_RMU_FOLD_BATCH; fold_ok checks this one)
        self.fold_batch = int(settings.get().rmu_fold_batch)

    @classmethod
    def for_device(cls, device, cfg: "A.AdamWConfig") -> Optional["Fused"]:
        """The fast path for `device` if it is CUDA, wanted, builds, and passes the self-check."""
        global why_not
        device = torch.device(device)
        if device.type != "cuda" or not wanted():
            why_not = "not a CUDA device" if device.type != "cuda" else "LETO_RMU_FUSED=0"
            return None
        lay = layout()      # a bad LETO_RMU_FUSED_LAYOUT is the user's to fix, not a fallback
        key = (str(device), cfg, lay)
        if key not in _cache:
            f, bad = None, ""
            try:
                ext = load()
                env = settings.get().rmu_fused_variant
                # The kernel's spellings of torch's ops (adamw_cuda.cu); the first one whose bits
                # equal adamw_chunk_'s on this device is used.  A formula that rounds differently
                # anywhere differs in a large share of the ~3M checked updates (H200: >= 500).
                order = [env] if env is not None else [0, 8, *[v for v in range(16) if v not in (0, 8)]]
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

    def _hyper(self, step: int, lr: float):
        cfg = self.cfg
        beta1, beta2 = cfg.betas
        lr, s = float(lr), float(step)
        bc1, bc2 = 1 - beta1 ** s, 1 - beta2 ** s
        return (1 - lr * cfg.weight_decay, beta1, beta2, cfg.eps, bc2 ** 0.5, lr / bc1,
                cfg.weight_decay != 0)

    def step_(self, p, m, v, g, *, step: int, lr: float, coef: Optional[torch.Tensor],
              deltas: Optional[Sequence[torch.Tensor]] = None) -> None:
        """adamw_chunk_(p, m, v, g, step=, lr=, cfg=, coef=) in one kernel; with `deltas`
        (3 tensors of len(p) * 4 bytes) also writes old ^ new of p, m, v there."""
        self.ext.adamw_fused(p, m, v, g, None if coef is None else coef.reshape(1),
                             None if deltas is None else list(deltas), *self._hyper(step, lr),
                             self.variant)

    # ---- AdamW and the parity delta in one kernel ---------------------------------------------
    def syndrome_ok(self, device, m: int = 16) -> bool:
        """chunk_syndrome_ may be used on `device` with m parity pages per group: not turned
        off (LETO_RMU_FUSED_SYNDROME=0), compiled for this spelling (variant 0) and bit-identical to
        the two-kernel path (checked once)."""
        global why_not_syndrome
        if not settings.get().rmu_fused_syndrome:
            why_not_syndrome = "LETO_RMU_FUSED_SYNDROME=0"
            return False
        key = ("syndrome", str(torch.device(device)), self.cfg, self.variant, self.candidates, m)
        if key not in _cache:
            bad = ("only AdamW spelling 0 is compiled into the syndrome kernel, this device needs "
                   f"{self.variant}") if self.variant != 0 else ""
            picked, why = None, []
            for lay in ([] if bad else self.candidates):
                self.layout = lay
                try:
                    b = self.syndrome_check(torch.device(device), m)
                except Exception as e:          # build or launch failure: next layout, say why
                    b = f"{type(e).__name__}: {e}"
                if not b:
                    picked = lay
                    break
                why.append(f"layout {_name(lay)}: {b}")
            bad = bad or "; ".join(why)
            if picked is None:
                log.warning("leto.rmu: AdamW + parity kernel not used: %s", bad)
            elif why:
                log.warning("leto.rmu: AdamW + parity kernel in layout %s (%s)", _name(picked), "; ".join(why))
            why_not_syndrome = "" if picked is not None else bad
            _cache[key] = picked
        if _cache[key] is not None:
            self.layout = _cache[key]
        return _cache[key] is not None
        return _cache[key]

    def chunk_syndrome_(self, states: Sequence[torch.Tensor], undo: Sequence[torch.Tensor], g, *,
                        step: int, lr: float, coef: Optional[torch.Tensor], code, first: int,
                        outs: Sequence[torch.Tensor], bases: Sequence[torch.Tensor]) -> None:
        """One chunk of whole pages at position `first` of `code`'s group: states (p, m, v, fp32
        views) <- AdamW from `undo` (their values before the step, same sizes) and g; per state y,
        outs[y] (the code's m parity pages, (m, S) uint8) = bases[y] ^ the parity delta of
        undo[y] ^ new[y].  The same bits as step_(deltas=) followed by code.update_delta_many."""
        self.ext.adamw_syndrome(*self._chunk_args(states, undo, g, step=step, lr=lr, coef=coef, code=code,
                                                  first=first, outs=outs, bases=bases), self.variant, self.layout)

    def fold_ok(self, device, m: int = 16) -> bool:
        """chunk_fold_ (always the ws kernel, whatever the one-kernel chunk's layout) may be
        used on `device`: it gives the one-kernel chunk's bits, the undo copy and full counts
        (checked once; `why_not_fold` says why not).  A batch of 4 that fails here (it needs
        about 198 KiB of shared memory per CTA) falls back to counting every stage."""
        global why_not_fold
        key = ("fold", str(torch.device(device)), self.cfg, self.variant, m, self.fold_batch)
        if key not in _cache:
            try:
                bad = self.syndrome_check(torch.device(device), m, kernel="fold")
            except Exception as e:          # build or launch failure: the undo copy stays
                bad = f"{type(e).__name__}: {e}"
            if bad:
                log.warning("leto.rmu: folded chunk (a count every %d stage(s)) not used: %s",
                            self.fold_batch, bad)
            why_not_fold = bad
            _cache[key] = not bad
        if not _cache[key] and self.fold_batch != 1:
            self.fold_batch = 1             # counting every stage, if that one passes
            return self.fold_ok(device, m)
        return _cache[key]

    def chunk_fold_(self, states: Sequence[torch.Tensor], undo: Sequence[torch.Tensor], g, *,
                    step: int, lr: float, coef: Optional[torch.Tensor], code, first: int,
                    outs: Sequence[torch.Tensor], bases: Sequence[torch.Tensor],
                    counts: Sequence[torch.Tensor], tag: int, batch: Optional[int] = None) -> None:
        """chunk_syndrome_ with the undo copy folded in (cuda/adamw_ws.cu): the states are read
        in place, their old values written to `undo`, and `counts` (two int64 copies of
        fold.units words) say per unit which stages' undo copy is visible (fold.py), stored every
        `fold_batch` stages."""
        self.ext.adamw_syndrome_fold(*self._chunk_args(states, undo, g, step=step, lr=lr, coef=coef, code=code,
                                                       first=first, outs=outs, bases=bases),
                                     counts[0], counts[1], tag, batch or self.fold_batch)

    def chunk_bench_(self, kernel: str, states: Sequence[torch.Tensor], undo: Sequence[torch.Tensor], g, *,
                     step: int, lr: float, coef: Optional[torch.Tensor], code, first: int,
                     outs: Sequence[torch.Tensor], bases: Sequence[torch.Tensor],
                     progress: Optional[torch.Tensor] = None, counts=None) -> None:
        """chunk_syndrome_ through one of the benchmarks' kernels (`BENCH_KERNELS`, extension
        `load_fold`; the updater uses none of them): the same new states and parity bits.  The
        folding ones read the states in place and *write* their old values to `undo`; those in
        `BENCH_READS_UNDO` read `undo` as chunk_syndrome_ does.  "fold+counts": `progress` (int32, 3 x 4 KiB tiles
        of a page, zeroed) counts per state and tile the 2-page stages whose undo copy is
        visible (`fold_stages`); a stage's new values are stored only once counted."""
        if kernel not in BENCH_KERNELS:
            raise ValueError(f"chunk_bench_: kernel {kernel!r} is not one of {', '.join(BENCH_KERNELS)}")
        if self.variant != 0:
            raise ValueError("chunk_bench_: only AdamW spelling (variant) 0 is compiled")
        if kernel.startswith("ws-fold+counts"):  # /1: the updater's kernel, in the main extension
            u = FD.units(code.page_bytes)
            if counts is None:
                if getattr(self, "_bench_counts", None) is None or self._bench_counts[0].numel() != u:
                    self._bench_counts = [torch.zeros(u, dtype=torch.int64, device=states[0].device) for _ in range(2)]
                counts = self._bench_counts
            kw = dict(step=step, lr=lr, coef=coef, code=code, first=first, outs=outs, bases=bases)
            if kernel == "ws-fold+counts":
                self.chunk_fold_(states, undo, g, counts=counts, tag=FD.tag(step, first, code.k), batch=1, **kw)
            else:
                load_fold().adamw_syndrome_ws_counts(*self._chunk_args(states, undo, g, **kw), counts[0], counts[1],
                                                     FD.tag(step, first, code.k), int(kernel.rsplit("/", 1)[1]))
            return
        ext = load_fold()
        args = self._chunk_args(states, undo, g, step=step, lr=lr, coef=coef, code=code, first=first,
                                outs=outs, bases=bases)
        if kernel.startswith("fold"):
            ext.adamw_syndrome_fold(*args, progress if kernel == "fold+counts" else None)
        else:
            tile = ext.adamw_syndrome_ws if kernel.startswith("ws") else ext.adamw_syndrome_onecta
            tile(*args, kernel not in BENCH_READS_UNDO)

    def _chunk_args(self, states, undo, g, *, step, lr, coef, code, first, outs, bases) -> tuple:
        import numpy as np

        from leto_runtime.parity import delta as D, gf16
        from leto_runtime.parity.backends import cuda_backend
        dev = states[0].device
        be = cuda_backend()             # its address arrays and operand helpers, whatever code's backend
        rows = lambda ts: [r for t in ts for r in t.unbind(0)]  # noqa: E731
        f32 = lambda t: t.reshape(-1).view(torch.float32)      # noqa: E731
        mix = be._window(np.asarray(gf16.encode_matrix(code.k, code.m)), code.exponents)
        sc = be.scale_window(code.exponents, D.run_scale(code.m, first))
        return (*[f32(t) for t in states], f32(g), *[f32(t) for t in undo],
                None if coef is None else coef.reshape(1),
                be._ptrs(rows(outs), dev), be._ptrs(rows(bases), dev), mix, sc,
                code.page_bytes, *self._hyper(step, lr))

    def syndrome_check(self, device, m: int = 16, kernel: str = "copy") -> str:
        """'' when chunk_syndrome_ (kernel "copy"; "fold": chunk_fold_, whose undo copy and
        counts are checked too; else chunk_bench_ with that kernel) gives the
        two-kernel path's bits on `device`, else what differed.  Cases: a baked (k = 1024, m = 16) and run-time (k = 664, and this job's m)
        mix; runs at offsets that exercise the run scale; a run longer than one 16-page Horner
        period; a page that ends in a partial tile (13 KiB); clipping and weight decay on and
        off; steps 1 and 3."""
        from dataclasses import replace

        from leto_runtime.parity import ParityCode
        gen = torch.Generator(device="cpu").manual_seed(0x5E1F)
        cases = [(1024, 16, 333, 5, 1.0, self.cfg.weight_decay, 16 << 10),
                 (664, m, 600, 19, None, self.cfg.weight_decay, 13 << 10),
                 (1024, m, 0, 2, 1.0, 0.0, 16 << 10)]
        for k, mm, first, n, clip, wd, S in cases:
            E = S // 4
            cfg = replace(self.cfg, clip_grad_norm=clip, weight_decay=wd)
            code = ParityCode(k, mm, S, backend="cuda")
            f = Fused(self.ext, cfg, self.variant)
            f.layout = self.layout          # the layout under check, whatever the environment says
            f.fold_batch = self.fold_batch  # (and the folded kernel's batch)
            st = [torch.randn(n * E, generator=gen) for _ in range(2)] + [torch.rand(n * E, generator=gen)]
            st = [t.to(device) for t in st]
            ref = [t.clone() for t in st]
            q = [torch.randint(0, 256, (mm, S), generator=gen, dtype=torch.uint8).to(device) for _ in range(3)]
            coef = torch.tensor(0.37, device=device) if clip else None
            for step in (1, 3):
                g = (torch.randn(n * E, generator=gen) * 0.1).to(device)
                undo = [t.clone() for t in st]
                d = [torch.empty(n * E, dtype=torch.int32, device=device) for _ in range(3)]
                f.step_(*ref, g, step=step, lr=cfg.lr, coef=coef, deltas=d)
                want = [torch.empty_like(x) for x in q]
                code.update_delta_many(want, range(first, first + n), [x.view(torch.uint8).view(n, S) for x in d],
                                       bases=q)
                got = [torch.empty_like(x) for x in q]
                where = f"k={k} m={mm} first={first} n={n} S={S} step {step}"
                kw = dict(step=step, lr=cfg.lr, coef=coef, code=code, first=first, outs=got, bases=q)
                if kernel == "copy" or kernel in BENCH_READS_UNDO:
                    (f.chunk_syndrome_(st, undo, g, **kw) if kernel == "copy"
                     else f.chunk_bench_(kernel, st, undo, g, **kw))
                else:
                    written = [torch.full_like(t, float("nan")) for t in st]
                    prog = torch.zeros(3 * -(-S // 4096), dtype=torch.int32, device=device)
                    counts = [torch.full((FD.units(S),), -1, dtype=torch.int64, device=device) for _ in range(2)]
                    tg = FD.tag(step, first, code.k)
                    counted = kernel == "fold" or kernel.startswith("ws-fold+counts")
                    (f.chunk_fold_(st, written, g, counts=counts, tag=tg, **kw) if kernel == "fold"
                     else f.chunk_bench_(kernel, st, written, g, progress=prog, counts=counts, **kw))
                    for name, a, b in zip(("params", "exp_avg", "exp_avg_sq"), undo, written):
                        if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                            return f"{where}: the {name} undo copy is not the values before the step"
                    if kernel == "fold+counts" and not bool((prog == fold_stages(n)).all()):
                        return f"{where}: stage counts {prog.tolist()} after the chunk, not {fold_stages(n)}"
                    full = (tg << 16) | FD.n_stages(n)
                    if counted and not all(bool((c == full).all()) for c in counts):
                        return (f"{where}: fold counts {sorted(set(counts[0].tolist()))} after the chunk, "
                                f"not {full} (tag {tg}, {FD.n_stages(n)} stages) in both copies")
                for name, a, b in zip(("params", "exp_avg", "exp_avg_sq"), ref, st):
                    if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                        return f"{where}: {name} differs from the fused AdamW kernel"
                for name, a, b in zip(("params", "exp_avg", "exp_avg_sq"), want, got):
                    if not torch.equal(a, b):
                        return f"{where}: the {name} parity differs from the two-kernel path"
                q = got
        return ""

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
