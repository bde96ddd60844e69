"""leto_runtime.torch_optim: what describe() reads from stock torch optimizers (two groups each,
round trip through set_group_values), and every refusal's message, through describe() and
through its check_* function."""
from __future__ import annotations

import math

import pytest
import torch
from torch.optim import optimizer as torch_optimizer

from leto_runtime.rmu.chunk_math import Hyper
from leto_runtime.torch_optim import (UnsupportedOptimizer, check_amsgrad,
                                      check_capturable, check_device, check_differentiable,
                                      check_foreach, check_fused, check_hooks, check_params,
                                      check_tensor_values, check_type, describe, ordered_params,
                                      set_group_values)


def _ps(*sizes, dtype=torch.float32):
    return [torch.nn.Parameter(torch.randn(n, dtype=dtype)) for n in sizes]


def _two_groups(**second):
    return [{"params": _ps(3, 4)}, {"params": _ps(5), **second}]


# describe / set_group_values ----------------------------------------------------------------

def test_describe_adamw_two_groups():
    opt = torch.optim.AdamW(_two_groups(lr=1e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0,
                                        maximize=True),
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    assert describe(opt, "cpu") == [
        Hyper("adamw", lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1),
        Hyper("adamw", lr=1e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0, maximize=True)]


def test_describe_adam_two_groups_and_decoupled_weight_decay():
    # In this torch, AdamW is Adam with decoupled_weight_decay=True, a per-group option.
    opt = torch.optim.Adam(_two_groups(lr=0.5, weight_decay=0.2, decoupled_weight_decay=True),
                           lr=1e-3, weight_decay=0.01)
    assert describe(opt, "cpu") == [
        Hyper("adam", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01),
        Hyper("adamw", lr=0.5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.2)]
    whole = torch.optim.Adam(_ps(3), lr=1e-3, weight_decay=0.1, decoupled_weight_decay=True)
    assert [h.kind for h in describe(whole, "cpu")] == ["adamw"]


def test_describe_sgd_two_groups():
    opt = torch.optim.SGD(_two_groups(lr=0.01, momentum=0.9, dampening=0.0, nesterov=True,
                                      maximize=True),
                          lr=0.1, momentum=0.5, dampening=0.3, weight_decay=1e-4)
    assert describe(opt, "cpu") == [
        Hyper("sgd", lr=0.1, momentum=0.5, dampening=0.3, weight_decay=1e-4),
        Hyper("sgd", lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4, maximize=True)]
    plain = torch.optim.SGD(_ps(2), lr=1)        # int lr: a float Hyper of the same value
    (h,) = describe(plain, "cpu")
    assert h == Hyper("sgd", lr=1.0) and type(h.lr) is float and h.n_states == 0


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False),
    lambda ps: torch.optim.Adam(ps, lr=1e-3),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
], ids=["adamw", "adam", "sgd"])
def test_set_group_values_round_trips(make):
    opt = make(_two_groups())
    hs = describe(opt, "cpu")
    if hs[0].kind == "sgd":
        new = [Hyper("sgd", lr=0.1 + 0.2, momentum=0.8, dampening=0.1, weight_decay=1e-3),
               Hyper("sgd", lr=0.0, momentum=0.95, nesterov=True, maximize=True)]
    else:
        k = hs[0].kind
        new = [Hyper(k, lr=0.1 + 0.2, beta1=0.5, beta2=0.9, eps=1e-7, weight_decay=0.3),
               Hyper(k, lr=0.0, beta1=0.0, beta2=1 - 2**-40, eps=0.0, maximize=True)]
    set_group_values(opt, new)
    assert describe(opt, "cpu") == new
    if new[0].kind != "sgd":
        assert opt.param_groups[0]["betas"] == (0.5, 0.9)
        assert isinstance(opt.param_groups[0]["betas"], tuple)
    set_group_values(opt, hs)
    assert describe(opt, "cpu") == hs


def test_set_group_values_refusals():
    opt = torch.optim.AdamW(_two_groups(), lr=1e-3)
    hs = describe(opt, "cpu")
    with pytest.raises(ValueError, match=r"1 Hyper values for 2 param groups"):
        set_group_values(opt, hs[:1])
    with pytest.raises(ValueError, match=r"hypers\[1\].kind='adam' but param_groups\[1\] of AdamW is 'adamw'"):
        set_group_values(opt, [hs[0], Hyper("adam", lr=1.0)])
    with pytest.raises(ValueError, match=r"hypers\[0\] is dict, not a Hyper"):
        set_group_values(opt, [hs[0].to_json(), hs[1]])
    assert describe(opt, "cpu") == hs, "a refused call wrote"


def test_ordered_params_and_duplicates():
    groups = _two_groups()
    opt = torch.optim.SGD(groups, lr=0.1)
    got = ordered_params(opt)
    assert [[id(p) for p in g] for g in got] == [[id(p) for p in g["params"]] for g in groups]
    opt.param_groups[1]["params"].append(opt.param_groups[0]["params"][1])
    with pytest.raises(UnsupportedOptimizer, match=r"param_groups\[1\]\['params'\]\[1\] is also "
                                                   r"param_groups\[0\]\['params'\]\[1\]"):
        ordered_params(opt)
    with pytest.raises(UnsupportedOptimizer, match=r"is also param_groups"):
        describe(opt, "cpu")


# refusals -----------------------------------------------------------------------------------

def test_subclass_refused():
    class MyAdamW(torch.optim.AdamW):
        pass

    opt = MyAdamW(_ps(3), lr=1e-3)
    with pytest.raises(UnsupportedOptimizer, match=r"MyAdamW is a subclass of a supported optimizer; "
                                                   r"Leto supports exactly torch.optim.AdamW"):
        describe(opt, "cpu")
    assert "not subclasses" in check_type(opt)


def test_other_optimizers_refused_with_the_supported_list():
    for opt in (torch.optim.RMSprop(_ps(3), lr=1e-3), torch.optim.Adagrad(_ps(3))):
        with pytest.raises(UnsupportedOptimizer) as e:
            describe(opt, "cpu")
        msg = str(e.value)
        assert type(opt).__name__ + " is not supported" in msg
        assert "Leto supports torch.optim.AdamW, torch.optim.Adam and torch.optim.SGD" in msg
        assert "element-wise" in msg and "Muon" in msg and "not implemented" in msg
    assert check_type(object()) is not None and check_type(torch.optim.SGD(_ps(1), lr=0.1)) is None


@pytest.mark.parametrize("make,check,match", [
    (lambda: torch.optim.Adam(_ps(3), amsgrad=True), check_amsgrad,
     r"amsgrad=True is not supported .*; pass amsgrad=False"),
    (lambda: torch.optim.AdamW(_ps(3), capturable=True), check_capturable,
     r"capturable=True is not supported .*; pass capturable=False"),
    (lambda: torch.optim.AdamW(_ps(3), differentiable=True), check_differentiable,
     r"differentiable=True is not supported .*; pass differentiable=False"),
    (lambda: torch.optim.SGD(_ps(3), lr=0.1, differentiable=True), check_differentiable,
     r"differentiable=True is not supported"),
    (lambda: torch.optim.AdamW(_ps(3), fused=True), check_fused,
     r"fused=True is not supported .*; pass fused=False"),
    (lambda: torch.optim.SGD(_ps(3), lr=0.1, fused=True), check_fused, r"fused=True is not supported"),
    (lambda: torch.optim.AdamW(_ps(3), lr=torch.tensor(1e-3)), check_tensor_values,
     r"a Tensor lr is not supported; pass Python floats"),
    (lambda: torch.optim.Adam(_ps(3), betas=(torch.tensor(0.9), torch.tensor(0.99))),
     check_tensor_values, r"a Tensor betas\[0\], betas\[1\] is not supported; pass Python floats"),
    (lambda: torch.optim.SGD(_ps(3), lr=0.1, weight_decay=torch.tensor(0.1)), check_tensor_values,
     r"a Tensor weight_decay is not supported"),
])
def test_group_option_refusals(make, check, match):
    opt = make()
    with pytest.raises(UnsupportedOptimizer, match=r"param_groups\[0\]: " + match):
        describe(opt, "cpu")
    assert check(opt.param_groups[0]) is not None
    assert check({"params": []}) is None, "a default group passes"


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD])
def test_foreach(cls):
    def make(foreach):
        return cls(_ps(3), lr=0.1, foreach=foreach)

    # CPU: torch's foreach ops run the single-tensor kernels (test_rmu_chunk_math checks the bits).
    for fe in (True, None, False):
        assert describe(make(fe), "cpu")
    with pytest.raises(UnsupportedOptimizer, match=r"foreach=True is not supported on CUDA: .*"
                                                   r"different bits.*; pass foreach=False"):
        describe(make(True), "cuda")
    with pytest.raises(UnsupportedOptimizer, match=r"foreach=None \(the default, which picks "
                                                   r"foreach on CUDA\).*pass foreach=False"):
        describe(make(None), "cuda:0")
    assert check_foreach(make(False).param_groups[0], "cuda") is None
    # foreach=False passes that check; CPU parameters are then refused for a CUDA job.
    with pytest.raises(UnsupportedOptimizer, match=r"params\[0\] \(shape \(3,\)\) is on cpu, not on "
                                                   r"the job's device cuda"):
        describe(make(False), "cuda")


def test_parameter_refusals():
    bf16 = torch.optim.AdamW(_ps(3, dtype=torch.bfloat16))
    with pytest.raises(UnsupportedOptimizer, match=r"params\[0\] \(shape \(3,\)\) is torch.bfloat16; "
                                                   r"float32 parameters are supported .*torch.autocast"):
        describe(bf16, "cpu")
    f64 = torch.optim.SGD([{"params": _ps(2)}, {"params": _ps(4, dtype=torch.float64)}], lr=0.1)
    with pytest.raises(UnsupportedOptimizer, match=r"param_groups\[1\]: params\[0\] .* is torch.float64"):
        describe(f64, "cpu")
    cplx = torch.optim.SGD(_ps(3, dtype=torch.complex64), lr=0.1)
    with pytest.raises(UnsupportedOptimizer, match=r"is complex \(torch.complex64\); only real float32"):
        describe(cplx, "cpu")
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (3,),
                                     check_invariants=True)
    with pytest.raises(UnsupportedOptimizer, match=r"is sparse \(torch.sparse_coo\); only dense"):
        describe(torch.optim.SGD([sparse], lr=0.1), "cpu")
    (p,) = _ps(3)
    p.grad = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (3,),
                                     check_invariants=True)
    with pytest.raises(UnsupportedOptimizer, match=r"has a sparse gradient .*sparse=False"):
        describe(torch.optim.SGD([p], lr=0.1), "cpu")
    assert check_params({"params": _ps(1, 2)}, "cpu") is None


def test_step_hook_refusals():
    opt = torch.optim.AdamW(_ps(3))
    for register, what in ((opt.register_step_pre_hook, "a step pre-hook on this optimizer"),
                           (opt.register_step_post_hook, "a step post-hook on this optimizer"),
                           (torch_optimizer.register_optimizer_step_pre_hook, "a global step pre-hook"),
                           (torch_optimizer.register_optimizer_step_post_hook, "a global step post-hook")):
        handle = register(lambda *a, **k: None)
        try:
            with pytest.raises(UnsupportedOptimizer, match=rf"optimizer step hooks are registered: "
                                                           rf"{what}.*would not run; remove them"):
                describe(opt, "cpu")
        finally:
            handle.remove()
        assert check_hooks(opt) is None
    assert describe(opt, "cpu")


@pytest.mark.parametrize("key,value,match", [
    ("weight_decay", -0.1, r"Hyper.weight_decay=-0.1: must be >= 0"),
    ("lr", -1e-3, r"Hyper.lr=-0.001: must be >= 0"),
    ("lr", math.nan, r"Hyper.lr=nan: must be a finite"),
    ("betas", (0.9, 1.0), r"Hyper.beta2=1.0: must be in \[0, 1\)"),
    ("eps", -1.0, r"Hyper.eps=-1.0: must be >= 0"),
])
def test_values_changed_after_construction_are_checked(key, value, match):
    opt = torch.optim.AdamW(_two_groups(), lr=1e-3)
    opt.param_groups[1][key] = value
    with pytest.raises(UnsupportedOptimizer, match=r"param_groups\[1\]: " + match):
        describe(opt, "cpu")


def test_sgd_nesterov_group_inheriting_dampening_is_refused():
    # torch checks nesterov against the constructor's defaults only; this group would run
    # Nesterov with dampening 0.3 inherited from them.  Hyper refuses it, as torch's rule says.
    opt = torch.optim.SGD(_two_groups(momentum=0.9, nesterov=True), lr=0.1, dampening=0.3)
    with pytest.raises(UnsupportedOptimizer, match=r"param_groups\[1\]: .*zero dampening"):
        describe(opt, "cpu")


def test_sgd_values_changed_after_construction_are_checked():
    opt = torch.optim.SGD(_ps(3), lr=0.1, momentum=0.9, nesterov=True)
    opt.param_groups[0]["dampening"] = 0.5
    with pytest.raises(UnsupportedOptimizer, match=r"param_groups\[0\]: .*Nesterov momentum requires"):
        describe(opt, "cpu")


def test_device_refused():
    assert check_device("cpu") is None and check_device("cuda:1") is None
    with pytest.raises(UnsupportedOptimizer, match=r"device meta is not supported: .*CPU or CUDA only"):
        describe(torch.optim.SGD(_ps(3), lr=0.1), "meta")
