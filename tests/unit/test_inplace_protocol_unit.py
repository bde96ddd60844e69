"""Pieces of the in-place protocol without trainers: the env the agent writes for shadows, the
agent's HOF watcher and the runtime's promotion wait, against a real TCPStore."""
import datetime
import json
import os
import select
import threading
import time

import pytest
import torch.distributed as dist

from leto_run.heartbeat import HeartbeatServer
from leto_run.hof_watch import HofWatcher
from leto_run.worker_env import WorkerEnvSpec, WorkerIdentity, build_worker_env
from leto_runtime.wire import contract as C
from leto_runtime import Context, promotion, runtime
from leto_runtime.auth_store import AuthStore

KEY = bytes(range(32))                    # the job's MAC key (LETO_JOB_KEY)


def spec(**kw):
    ident = WorkerIdentity(local_rank=0, global_rank=1, role_rank=1, world_size=2,
                           role_world_size=2, local_world_size=2, group_rank=0,
                           group_world_size=1, role_name="default")
    base = dict(identity=ident, master_addr="h", master_port=1234, restart_count=0,
                max_restarts=0, run_id="rid", use_agent_store=True, error_file="/e.json",
                signals_to_handle="SIGTERM", slot_role="active", generation=0, run_dir="/r",
                heartbeat_socket="/r/hb.sock", hang_timeout=0, recovery="inplace", node="n",
                job_token="tok", dump_signal=C.DUMP_SIGNAL, job_key=KEY.hex())
    base.update(kw)
    return WorkerEnvSpec(**base)


def test_shadow_env_round_trip():
    env = build_worker_env({}, spec(slot_role="shadow", generation=3, shadow_epoch=2,
                                    pg_timeout=45.0, chunk_pages=8))
    assert (env[C.LETO_SHADOW_EPOCH], env[C.LETO_PG_TIMEOUT], env[C.LETO_CHUNK_PAGES]) == \
        ("2", "45.0", "8")
    ctx = Context.from_env(env)
    assert (ctx.role, ctx.generation, ctx.shadow_epoch, ctx.pg_timeout, ctx.chunk_pages) == \
        ("shadow", 3, 2, 45.0, 8)


@pytest.fixture
def server():
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=10))
    yield s


def test_watcher_wakes_on_the_hof_key_of_the_current_generation(server):
    r, w = os.pipe()
    gen = {"g": 2}
    watcher = HofWatcher("127.0.0.1", server.port, lambda: gen["g"], w)
    try:
        server.set(C.hof_key(1), "old generation: ignored")
        assert select.select([r], [], [], 0.5)[0] == []
        server.set(C.hof_key(2), json.dumps({"rank": 3}))
        assert select.select([r], [], [], 5)[0] == [r]
        assert os.read(r, 8) == b"h"
    finally:
        watcher.stop()
        assert not watcher.thread.is_alive()           # stop() ends and joins the thread
        os.close(r)
        os.close(w)


def test_wait_for_promotion_returns_when_the_go_key_is_set(server, tmp_path, monkeypatch):
    hb = HeartbeatServer(str(tmp_path / "hb.sock"))
    env = build_worker_env({}, spec(slot_role="shadow", generation=1, master_addr="127.0.0.1",
                                    master_port=server.port, heartbeat_socket=hb.path))
    ctx = Context.from_env(env)
    monkeypatch.setattr(os, "environ", env)
    monkeypatch.setattr(runtime.current(), "channel", None)   # a fresh channel, restored after
    store = promotion.worker_store(ctx, timeout=10)
    agent = AuthStore(server, KEY)            # the agent signs the go key it sets
    threading.Timer(0.3, lambda: agent.set(C.go_key(1, ctx.rank), "go")).start()
    t0 = time.monotonic()
    woke = promotion.wait_for_promotion(ctx, store, slice_s=0.2)
    assert 0.25 <= woke - t0 < 5
    promotion.report_phase("agree", 0.001, resume="finish", step=7)
    beats = hb.drain({os.getpid()})
    kinds = [b.kind for b in beats]
    assert "promoted" in kinds and "phase" in kinds
    phase = json.loads(next(b for b in beats if b.kind == "phase").detail)
    assert phase == {"phase": "agree", "seconds": 0.001, "resume": "finish", "step": 7}
    hb.close()
