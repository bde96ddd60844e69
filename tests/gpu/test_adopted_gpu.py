"""`job.optimizer` on CUDA (RMU's per-group update with torch ops, `LETO_PLAIN_RMU=1`) against
stock torch on the same GPU (`foreach=False`), bit for bit: the CPU test's twin
(tests/unit/test_adopted.py)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
from test_adopted import _leto, _same_state_dict, _stock, STEPS, cleanup  # noqa: E402,F401

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU")]


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd"])
def test_the_script_s_optimizer_matches_stock_torch_on_cuda(monkeypatch, cleanup, kind):  # noqa: F811
    torch.use_deterministic_algorithms(True)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    job, model, opt, losses, lrs = _leto(monkeypatch, kind, rmu=True, device="cuda")
    ref, topt, ref_losses, ref_lrs = _stock(kind, device="cuda")
    assert losses == ref_losses and lrs == ref_lrs and len(set(losses)) == STEPS
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), n
    _same_state_dict(opt.state_dict(), topt.state_dict())
