"""leto_runtime.rmu.chunk_math on the CPU, against independent oracles: stock torch.optim.Adam,
AdamW and SGD (foreach=False, and torch's CPU defaults) with clip_grad_norm_(foreach=False), bit
for bit on params and every state at every step; the whole-tensor update for any chunk split
(also under the DEFAULT, AVX2 and AVX512 CPU kernels, in subprocesses); exact redo from an undo
copy; exact JSON round trips of Hyper; and the validation messages."""
from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leto_runtime.rmu.adamw import clip_coef, grad_sq_norm, total_norm_from_sq
from leto_runtime.rmu.chunk_math import Hyper, adam_chunk_, sgd_chunk_, update_chunk_
from leto_testing import ROOT, base_env

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
# Odd sizes: tails shorter than every vector width.  Below TensorIterator's 32768-element grain
# (no thread split): torch and chunk_math run one whole-tensor op per parameter either way, and
# an intra-op thread split costs seconds per test on a loaded 2-core machine.  The thread split
# is exercised where it can matter, chunked against whole (test_chunked_equals_whole_large_unaligned
# and the per-capability subprocesses).
SIZES = ((1, 7, 129, 4099), (1000, 20_011))
STEPS = 6
# lr factor per step: a scheduler's changes between steps, including lr == 0.
LR_FACTOR = (1.0, 0.5, 0.0, 2.0, 0.25, 1.0)


def _grads(gen, t):
    scale = 0.05 if t % 3 else 0.001     # the 1.0 clip both triggers and does not
    return [[torch.randn(n, generator=gen) * scale for n in sizes] for sizes in SIZES]


def _torch_groups(params, hypers, t):
    out = []
    for ps, h in zip(params, hypers):
        d = dict(params=ps, lr=h.lr * LR_FACTOR[t], weight_decay=h.weight_decay, maximize=h.maximize)
        if h.kind == "sgd":
            d.update(momentum=h.momentum, dampening=h.dampening, nesterov=h.nesterov)
        else:
            d.update(betas=(h.beta1, h.beta2), eps=h.eps)
        out.append(d)
    return out


def _make_oracle(cls, init, hypers, foreach, **extra):
    params = [[torch.nn.Parameter(x.clone()) for x in g] for g in init]
    return params, cls(_torch_groups(params, hypers, 0), foreach=foreach, **extra)


def _check_against_torch(cls, hypers, clip, extra=None, seed=1234):
    """Step torch (foreach False/None/True on CPU) and chunk_math (with and without scratch) side
    by side and compare every param and state after every step."""
    gen = torch.Generator().manual_seed(seed)
    init = [[torch.randn(n, generator=gen) for n in sizes] for sizes in SIZES]
    oracles = [_make_oracle(cls, init, hypers, fe, **(extra or {})) for fe in (False, None, True)]
    ours = []
    for _ in range(2):
        P = [[x.clone() for x in g] for g in init]
        # Adam starts from zero moments; the SGD buffer is ignored at step 1: NaN proves it.
        S = [[tuple(torch.zeros(x.numel()) if h.kind != "sgd" else torch.full((x.numel(),), math.nan)
                    for _ in range(h.n_states)) for x in g] for g, h in zip(init, hypers)]
        ours.append((P, S))
    scratch = torch.empty(max(max(s) for s in SIZES) + 3)
    clipped = unclipped = 0
    for t in range(STEPS):
        grads = _grads(gen, t)
        flat = [g for gs in grads for g in gs]
        before = [g.clone() for g in flat]
        for params, opt in oracles:
            for ps, gs in zip(params, grads):
                for p, g in zip(ps, gs):
                    p.grad = g.clone()
            if clip is not None:
                ref_norm = torch.nn.utils.clip_grad_norm_([p for ps in params for p in ps], clip,
                                                          foreach=False)
            for group, h in zip(opt.param_groups, hypers):
                group["lr"] = h.lr * LR_FACTOR[t]
            opt.step()
        coef = None
        if clip is not None:
            norm = total_norm_from_sq(grad_sq_norm(flat))
            assert torch.equal(norm, ref_norm), (t, norm, ref_norm)
            coef = clip_coef(norm, clip)
            clipped += bool(coef < 1)
            unclipped += bool(coef == 1)
        for (P, S), scr in zip(ours, (None, scratch)):
            for i, h in enumerate(hypers):
                h_t = Hyper(**{**h.to_json(), "lr": h.lr * LR_FACTOR[t]})
                for j, g in enumerate(grads[i]):
                    update_chunk_(h_t, P[i][j], S[i][j], g, step=t + 1, coef=coef, scratch=scr)
        assert all(torch.equal(a, b) for a, b in zip(flat, before)), "g was written"
        for k, (params, opt) in enumerate(oracles):
            for (P, S), scr in zip(ours, ("no scratch", "scratch")):
                for i, h in enumerate(hypers):
                    for j, p in enumerate(params[i]):
                        where = (t, ("foreach=False", "foreach=None", "foreach=True")[k], scr, i, j)
                        assert torch.equal(P[i][j], p.detach()), (*where, "param")
                        state = opt.state[p]
                        assert set(state) - {"step"} == set(h.state_names), (*where, set(state))
                        for name, s in zip(h.state_names, S[i][j]):
                            assert torch.equal(s, state[name]), (*where, name)
    if clip is not None:
        assert clipped and unclipped, "the test must exercise both clipped and unclipped steps"


def _adam_hypers(kind, maximize):
    return [Hyper(kind, lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, maximize=maximize),
            Hyper(kind, lr=1e-3, beta1=0.8, beta2=0.999, eps=1e-6, weight_decay=0.0,
                  maximize=not maximize)]


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("variant", ["adam", "adamw", "adam(decoupled_weight_decay=True)"])
def test_adam_bitwise_equal_to_torch(variant, maximize, clip):
    if variant == "adam":
        cls, kind, extra = torch.optim.Adam, "adam", {}
    elif variant == "adamw":
        cls, kind, extra = torch.optim.AdamW, "adamw", {}
    else:
        cls, kind, extra = torch.optim.Adam, "adamw", {"decoupled_weight_decay": True}
    _check_against_torch(cls, _adam_hypers(kind, maximize), clip, extra)


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_adam_step_past_2_to_24_matches_torchs_float32_counter(kind, monkeypatch):
    """torch's step counter is a float32 tensor: past 2**24 `step += 1` no longer changes it, and
    its bias corrections keep using 2**24.  chunk_math does the same (betas this close to 1 make
    the difference visible in the bits)."""
    import leto_runtime.rmu.chunk_math as cm

    n, start = 4099, 2**24 - 2
    gen = torch.Generator().manual_seed(0)
    p0, m0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.01
    v0 = torch.rand(n, generator=gen) * 1e-4
    h = Hyper(kind, lr=1e-3, beta1=1 - 2**-24, beta2=1 - 2**-25, weight_decay=0.1)
    p = torch.nn.Parameter(p0.clone())
    opt = (torch.optim.AdamW if kind == "adamw" else torch.optim.Adam)(
        [p], lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps, weight_decay=h.weight_decay, foreach=False)
    opt.state[p] = {"step": torch.tensor(float(start)), "exp_avg": m0.clone(), "exp_avg_sq": v0.clone()}
    ours, unsaturated = [p0.clone(), m0.clone(), v0.clone()], [p0.clone(), m0.clone(), v0.clone()]
    differed = False
    for k in range(6):
        g = torch.randn(n, generator=gen) * 0.01
        p.grad = g.clone()
        opt.step()
        adam_chunk_(*ours, g, step=start + k + 1, h=h, coef=None)
        assert torch.equal(ours[0], p.detach()) and torch.equal(ours[1], opt.state[p]["exp_avg"])
        assert torch.equal(ours[2], opt.state[p]["exp_avg_sq"])
        with monkeypatch.context() as mp:           # what a plain float(step) would give
            mp.setattr(cm, "F32_STEP_LIMIT", 2**62)
            adam_chunk_(*unsaturated, g, step=start + k + 1, h=h, coef=None)
        differed |= not torch.equal(unsaturated[0], p.detach())
    assert opt.state[p]["step"].item() == 2**24
    assert differed, "the test must reach a step where the saturation changes the bits"


def _sgd_combos():
    out = []
    for momentum in (0.0, 0.9):
        for dampening in (0.0, 0.3):
            for nesterov in (False, True):
                if nesterov and (momentum == 0 or dampening != 0):
                    continue  # torch refuses it, and so does Hyper
                for wd in (0.0, 0.1):
                    for maximize in (False, True):
                        out.append((momentum, dampening, nesterov, wd, maximize))
    return out


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("momentum,dampening,nesterov,wd,maximize", _sgd_combos())
def test_sgd_bitwise_equal_to_torch(momentum, dampening, nesterov, wd, maximize, clip):
    hypers = [Hyper("sgd", lr=0.05, momentum=momentum, dampening=dampening, nesterov=nesterov,
                    weight_decay=wd, maximize=maximize),
              Hyper("sgd", lr=0.01, momentum=momentum and 0.5, dampening=dampening,
                    nesterov=nesterov, weight_decay=2 * wd, maximize=maximize)]
    _check_against_torch(torch.optim.SGD, hypers, clip)


def test_sgd_combos_cover_every_valid_one():
    assert len(_sgd_combos()) == 20


# Position independence, redo -------------------------------------------------------------------

HYPERS = [
    Hyper("adamw", lr=1e-2, beta1=0.9, beta2=0.95, weight_decay=0.1),
    Hyper("adam", lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1, maximize=True),
    Hyper("sgd", lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.1, maximize=True),
    Hyper("sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    Hyper("sgd", lr=0.1, weight_decay=0.1, maximize=True),
]


def _fresh(h, p0):
    return [p0.clone(), *(torch.zeros_like(p0) for _ in range(h.n_states))]


def _run(h, ts, grads, coef, cuts, scratch):
    p, *states = ts
    bounds = [0, *cuts, p.numel()]
    for t, g in enumerate(grads):
        for a, b in zip(bounds, bounds[1:]):
            update_chunk_(h, p[a:b], tuple(s[a:b] for s in states), g[a:b], step=t + 1,
                          coef=coef, scratch=scratch)


@SETTINGS
@given(h=st.sampled_from(HYPERS), n=st.integers(1, 3000), data=st.data(), clip=st.booleans(),
       use_scratch=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_chunked_equals_whole(h, n, data, clip, use_scratch, seed):
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, n - 1)), max_size=12)))
    cuts = [c for c in cuts if 0 < c < n]
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(3)]
    coef = torch.tensor(0.37) if clip else None
    whole, chunked = _fresh(h, p0), _fresh(h, p0)
    _run(h, whole, grads, coef, [], None)
    _run(h, chunked, grads, coef, cuts, torch.empty(n + 5) if use_scratch else None)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


@pytest.mark.parametrize("h", HYPERS, ids=lambda h: h.kind)
def test_chunked_equals_whole_large_unaligned(h):
    # Chunks at odd offsets (unaligned data pointers) and of sizes around the thread split.
    n = 100_003
    gen = torch.Generator().manual_seed(7)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(2)]
    coef = torch.tensor(0.5)
    whole, chunked = _fresh(h, p0), _fresh(h, p0)
    _run(h, whole, grads, coef, [], None)
    _run(h, chunked, grads, coef, [1, 3, 17, 32_769, 32_770, 70_001, 99_999], torch.empty(40_000))
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


@pytest.mark.parametrize("use_scratch", [False, True])
@pytest.mark.parametrize("with_coef", [False, True])
@pytest.mark.parametrize("step", [1, 4])
@pytest.mark.parametrize("h", HYPERS, ids=lambda h: h.kind)
def test_g_is_read_only_and_redo_is_exact(h, step, with_coef, use_scratch):
    """Interrupt the middle chunk, restore it from its undo copy, redo it: the result is the
    whole-tensor update, and g never changes."""
    n, a, b = 517, 100, 333
    gen = torch.Generator().manual_seed(3)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    states0 = [torch.randn(n, generator=gen).abs() for _ in range(h.n_states)]
    g_before = g.clone()
    coef = torch.tensor(0.25) if with_coef else None
    scratch = torch.empty(n) if use_scratch else None
    whole = [p0.clone(), *(s.clone() for s in states0)]
    update_chunk_(h, whole[0], tuple(whole[1:]), g, step=step, coef=coef, scratch=scratch)
    assert torch.equal(g, g_before)

    ts = [p0.clone(), *(s.clone() for s in states0)]

    def chunk(x, y):
        update_chunk_(h, ts[0][x:y], tuple(s[x:y] for s in ts[1:]), g[x:y], step=step,
                      coef=coef, scratch=scratch)

    chunk(0, a)
    undo = [t[a:b].clone() for t in ts]
    chunk(a, b)
    first = [t[a:b].clone() for t in ts]
    for t, u in zip(ts, undo):            # what the RMU does after a fault mid-chunk
        t[a:b].copy_(u)
    chunk(a, b)
    assert all(torch.equal(t[a:b], f) for t, f in zip(ts, first))
    chunk(b, n)
    assert all(torch.equal(x, y) for x, y in zip(ts, whole))
    assert torch.equal(g, g_before)


# Hyper ---------------------------------------------------------------------------------------

def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


@pytest.mark.parametrize("h", [
    Hyper("adamw", lr=0.1 + 0.2, beta1=1 - 2**-53, beta2=0.999, eps=1e-8, weight_decay=0.1),
    Hyper("adam", lr=5e-324, beta1=0.0, beta2=0.3, eps=0.0, weight_decay=1 / 3, maximize=True),
    Hyper("sgd", lr=2.2e-4, momentum=0.9, dampening=0.1 + 0.2, weight_decay=1e-8),
    Hyper("sgd", lr=1, momentum=0.9, nesterov=True),
    Hyper("sgd", lr=0.0),
])
def test_hyper_json_round_trip_is_exact(h):
    d = h.to_json()
    assert all(type(v) in (str, float, bool) for v in d.values()), d
    back = Hyper.from_json(json.loads(json.dumps(d)))
    assert back == h
    for k, v in d.items():
        if isinstance(v, float):
            assert _bits(getattr(back, k)) == _bits(v), k
    other = ("momentum", "dampening", "nesterov") if h.kind != "sgd" else ("beta1", "beta2", "eps")
    assert not set(d) & set(other), "to_json writes the kind's own fields only"


def test_n_states_and_state_names():
    assert Hyper("adamw", lr=1.0).state_names == ("exp_avg", "exp_avg_sq")
    assert Hyper("adam", lr=1.0).n_states == 2
    assert Hyper("sgd", lr=1.0, momentum=0.5).state_names == ("momentum_buffer",)
    assert Hyper("sgd", lr=1.0, momentum=0.5).n_states == 1
    assert Hyper("sgd", lr=1.0).state_names == () and Hyper("sgd", lr=1.0).n_states == 0


@pytest.mark.parametrize("kw,match", [
    (dict(kind="rmsprop", lr=1.0), r"Hyper.kind='rmsprop': must be one of"),
    (dict(kind="adamw", lr=-1e-3), r"Hyper.lr=-0.001: must be >= 0"),
    (dict(kind="adamw", lr=math.nan), r"Hyper.lr=nan: must be a finite"),
    (dict(kind="adamw", lr=math.inf), r"Hyper.lr=inf: must be a finite"),
    (dict(kind="adamw", lr=torch.tensor(1e-3)), r"Hyper.lr=.*a Tensor value is not supported"),
    (dict(kind="adamw", lr=True), r"Hyper.lr=True: must be a finite Python number"),
    (dict(kind="adam", lr=1.0, beta1=1.0), r"Hyper.beta1=1.0: must be in \[0, 1\)"),
    (dict(kind="adam", lr=1.0, beta2=-0.1), r"Hyper.beta2=-0.1: must be in \[0, 1\)"),
    (dict(kind="adam", lr=1.0, eps=-1e-8), r"Hyper.eps=-1e-08: must be >= 0"),
    (dict(kind="adam", lr=1.0, weight_decay=-0.1), r"Hyper.weight_decay=-0.1: must be >= 0"),
    (dict(kind="adam", lr=1.0, maximize=1), r"Hyper.maximize=1: must be a bool"),
    (dict(kind="adam", lr=1.0, momentum=0.9), r"Hyper.momentum=0.9: is not a field of kind 'adam'"),
    (dict(kind="sgd", lr=1.0, beta1=0.5), r"Hyper.beta1=0.5: is not a field of kind 'sgd'"),
    (dict(kind="sgd", lr=1.0, momentum=-0.9), r"Hyper.momentum=-0.9: must be >= 0"),
    (dict(kind="sgd", lr=1.0, nesterov=True), r"Nesterov momentum requires a momentum > 0"),
    (dict(kind="sgd", lr=1.0, momentum=0.9, dampening=0.1, nesterov=True),
     r"Nesterov momentum requires a momentum > 0 and zero dampening"),
])
def test_hyper_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        Hyper(**kw)


def test_hyper_from_json_refuses_unknown_keys_and_is_frozen():
    with pytest.raises(ValueError, match=r"unknown keys \['betas'\]"):
        Hyper.from_json({"kind": "adam", "lr": 1.0, "betas": [0.9, 0.99]})
    with pytest.raises(ValueError, match="expected a dict"):
        Hyper.from_json([("kind", "adam")])
    with pytest.raises(AttributeError):
        Hyper("adam", lr=1.0).lr = 2.0


def test_chunk_argument_validation():
    n = 8
    p, m, v, g = (torch.zeros(n) for _ in range(4))
    A, S = Hyper("adamw", lr=1.0), Hyper("sgd", lr=1.0, momentum=0.9)
    cases = [
        (lambda: adam_chunk_(p.double(), m, v, g, step=1, h=A, coef=None), r"adam_chunk_: p must be a 1-D float32"),
        (lambda: adam_chunk_(p, m.view(2, 4), v, g, step=1, h=A, coef=None), r"adam_chunk_: m must be .* got shape \(2, 4\)"),
        (lambda: adam_chunk_(p, m, v[:7], g, step=1, h=A, coef=None), r"adam_chunk_: v must be .* of 8 elements"),
        (lambda: adam_chunk_(p, m, v, g.to("meta"), step=1, h=A, coef=None), r"adam_chunk_: g must be .* on cpu, got .* on meta"),
        (lambda: adam_chunk_(p, m, v, g, step=0, h=A, coef=None), r"step=0 must be the 1-based"),
        (lambda: adam_chunk_(p, m, v, g, step=True, h=A, coef=None), r"step=True must be the 1-based"),
        (lambda: adam_chunk_(p, m, v, g, step=1, h=S, coef=None), r"h.kind='sgd'; use sgd_chunk_"),
        (lambda: adam_chunk_(p, m, v, g, step=1, h=A, coef=0.5), r"coef must be None or a 0-dim float32"),
        (lambda: adam_chunk_(p, m, v, g, step=1, h=A, coef=torch.tensor([0.5])), r"coef must be None or a 0-dim"),
        (lambda: adam_chunk_(p, m, v, g, step=1, h=A, coef=torch.tensor(0.5, dtype=torch.float64)), r"coef must be"),
        (lambda: adam_chunk_(p, m, v, g, step=1, h=A, coef=None, scratch=torch.empty(7)), r"scratch must be .* >= 8 elements"),
        (lambda: adam_chunk_(p, m, v, g, step=1, h={"kind": "adamw"}, coef=None), r"h must be a Hyper"),
        (lambda: sgd_chunk_(p, None, g, first=True, h=S, coef=None), r"buf is None but h.momentum=0.9"),
        (lambda: sgd_chunk_(p, m, g, first=True, h=Hyper("sgd", lr=1.0), coef=None), r"buf must be None when h.momentum == 0"),
        (lambda: sgd_chunk_(p, m[:4], g, first=True, h=S, coef=None), r"sgd_chunk_: buf must be .* of 8 elements"),
        (lambda: sgd_chunk_(p, m, g, first=1, h=S, coef=None), r"first=1 must be a bool"),
        (lambda: sgd_chunk_(p, m, g, first=True, h=A, coef=None), r"h.kind='adamw'; use adam_chunk_"),
        (lambda: update_chunk_(A, p, (m,), g, step=1, coef=None), r"kind 'adamw' takes 2 state tensor\(s\)"),
        (lambda: update_chunk_(S, p, (), g, step=1, coef=None), r"kind 'sgd' takes 1 state tensor\(s\) \('momentum_buffer',\)"),
        (lambda: update_chunk_(S, p, (m,), g, step=0, coef=None), r"step=0 must be the 1-based"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    assert all(torch.equal(t, torch.zeros(n)) for t in (p, m, v, g)), "a refused call wrote"


# CPU kernels ---------------------------------------------------------------------------------

_CAP_SCRIPT = r"""
import random, sys, torch
from leto_runtime.rmu.chunk_math import Hyper, update_chunk_
got = torch.backends.cpu.get_cpu_capability()
if got.lower() != sys.argv[1]:
    print("capability", got); sys.exit(3)
HYPERS = [Hyper("adamw", lr=1e-2, beta1=0.9, beta2=0.95, weight_decay=0.1),
          Hyper("adam", lr=1e-2, weight_decay=0.1, maximize=True),
          Hyper("sgd", lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.1, maximize=True),
          Hyper("sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1)]
def oracle(h, p0, grads, coef):
    p = torch.nn.Parameter(p0.clone())
    kw = dict(lr=h.lr, weight_decay=h.weight_decay, maximize=h.maximize, foreach=False)
    if h.kind == "sgd":
        o = torch.optim.SGD([p], momentum=h.momentum, dampening=h.dampening, nesterov=h.nesterov, **kw)
    else:
        o = (torch.optim.AdamW if h.kind == "adamw" else torch.optim.Adam)(
            [p], betas=(h.beta1, h.beta2), eps=h.eps, fused=False, **kw)
    for g in grads:
        p.grad = g * coef
        o.step()
    return [p.detach(), *(o.state[p][k] for k in h.state_names)]
def run(h, p0, grads, coef, cuts, scratch):
    ts = [p0.clone(), *(torch.zeros_like(p0) for _ in range(h.n_states))]
    b = [0, *cuts, p0.numel()]
    for t, g in enumerate(grads):
        for x, y in zip(b, b[1:]):
            update_chunk_(h, ts[0][x:y], tuple(s[x:y] for s in ts[1:]), g[x:y], step=t + 1,
                          coef=coef, scratch=scratch)
    return ts
rng = random.Random(0)
coef = torch.tensor(0.37)
for h in HYPERS:
    for n in (1, 17, 1000, 40_009):
        gen = torch.Generator().manual_seed(n)
        p0 = torch.randn(n, generator=gen)
        grads = [torch.randn(n, generator=gen) for _ in range(3)]
        whole = run(h, p0, grads, coef, [], None)
        assert all(torch.equal(a, b) for a, b in zip(whole, oracle(h, p0, grads, coef))), (h, n)
        for _ in range(4):
            cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(1, 10))))
            chunked = run(h, p0, grads, coef, cuts, torch.empty(n) if rng.random() < 0.5 else None)
            assert all(torch.equal(a, b) for a, b in zip(whole, chunked)), (h, n, cuts)
print("OK", got)
"""

_CAP_FLAGS = {"default": set(), "avx2": {"avx2", "fma"},
              "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}


def _cpu_flags() -> set[str] | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


@pytest.mark.parametrize("cap", ["default", "avx2", "avx512"])
def test_chunked_equals_whole_and_torch_per_cpu_capability(cap):
    flags = _cpu_flags()
    if _CAP_FLAGS[cap] and (flags is None or not _CAP_FLAGS[cap] <= flags):
        pytest.skip(f"this CPU lacks {cap} ({sorted(_CAP_FLAGS[cap])})")
    p = subprocess.run([sys.executable, "-c", _CAP_SCRIPT, cap], env=base_env(ATEN_CPU_CAPABILITY=cap),
                       cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    if p.returncode == 3:
        pytest.skip(f"torch does not run {cap} kernels here: {p.stdout.strip()}")
    assert p.returncode == 0 and p.stdout.startswith("OK"), (p.stdout, p.stderr[-3000:])
