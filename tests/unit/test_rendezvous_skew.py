"""A one-node job's first rendezvous round without torch's skew of several nodes' joins
(leto_run.rendezvous._no_skew): torch's real c10d rendezvous, with a recorder in front of the
delay function it calls (the recorder passes every call on)."""
from __future__ import annotations

import inspect

import pytest

from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from leto_run import job_secret
from leto_run.cli import load_config
from leto_run.rendezvous import make_handler, next_round
from leto_runtime.wire import contract as C


@pytest.fixture(autouse=True)
def _agent_setting_restored(monkeypatch):
    """make_handler sets the agent's own TORCH_DISABLE_SHARE_RDZV_TCP_STORE (rendezvous.py):
    in this process it must not outlive the test (set here as the agent does: undone after)."""
    monkeypatch.setenv(C.TORCH_SHARE_RDZV_STORE_OFF, "1")


def test_torch_still_skews_its_first_round():
    """What `_no_skew` leaves out is there (if torch drops it, so can we)."""
    src = inspect.getsource(dynamic_rendezvous.DynamicRendezvousHandler.next_rendezvous)
    assert "_delay(seconds=(0, 0.3))" in src and "state.round == 0" in src


def _round(monkeypatch, single_node: bool) -> list:
    calls = []
    real = dynamic_rendezvous._delay

    def recorder(seconds):
        calls.append(seconds)
        real(seconds)

    monkeypatch.setattr(dynamic_rendezvous, "_delay", recorder)
    cfg = load_config(["--nproc-per-node", "1", "train.py"], env={})
    handler, addr, port = make_handler(cfg, job_secret.job_key(cfg))
    try:
        r = next_round(handler, round_no=0, restart_count=0, role="default", local_world_size=1,
                       master_addr=addr, master_port=port, store_timeout=30,
                       single_node=single_node)
        assert r.identities[0].global_rank == 0
    finally:
        handler.shutdown()
    assert dynamic_rendezvous._delay is recorder          # put back after the round
    return calls


def test_a_one_node_job_s_first_round_is_not_skewed(monkeypatch):
    assert not any(isinstance(s, tuple) for s in _round(monkeypatch, single_node=True))


def test_a_job_of_several_nodes_keeps_torch_s_skew(monkeypatch):
    assert (0, 0.3) in _round(monkeypatch, single_node=False)
