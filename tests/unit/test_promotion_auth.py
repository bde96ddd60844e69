"""A shadow acts only on a go key that verifies with the job's key: a forged one (another
process wrote it without the key) is reported to the agent and ignored, and the genuine one
still wakes it.  Real processes: a TCPStore, the agent's heartbeat socket, a shadow process in
`promotion.wait_for_promotion`."""
import dataclasses
import datetime
import json
import os
import select
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from leto_run.heartbeat import HeartbeatServer
from leto_run.worker_env import WorkerEnvSpec, WorkerIdentity, build_worker_env
from leto_runtime import Context
from leto_runtime.wire import contract as C
from leto_runtime.auth_store import AuthStore
from leto_runtime.control_auth import key_to_hex
from leto_testing import ROOT

KEY = os.urandom(32)
SHADOW = """
from leto_runtime import Context, promotion
ctx = Context.from_env()
store = promotion.worker_store(ctx, timeout=30)
promotion.install_wake()
print("waiting", flush=True)
promotion.wait_for_promotion(ctx, store, slice_s=0.1)
print("woke", flush=True)
"""


def _env(port: int, hb_path: str) -> dict:
    ident = WorkerIdentity(local_rank=0, global_rank=1, role_rank=1, world_size=2,
                           role_world_size=2, local_world_size=1, group_rank=0,
                           group_world_size=1, role_name="default")
    spec = WorkerEnvSpec(identity=ident, master_addr="127.0.0.1", master_port=port,
                         restart_count=0, max_restarts=0, run_id="rid", use_agent_store=True,
                         error_file="/nonexistent/e.json", signals_to_handle="SIGTERM",
                         slot_role="shadow", generation=1, run_dir="/r", heartbeat_socket=hb_path,
                         hang_timeout=0, recovery="inplace", node="n", job_token="tok",
                         dump_signal=C.DUMP_SIGNAL, job_key=key_to_hex(KEY))
    return {**build_worker_env(os.environ, spec), "PYTHONPATH": str(ROOT)}


def _line(proc, deadline: float) -> str:
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.2)[0]:
            return proc.stdout.readline().strip()
        if proc.poll() is not None:
            break
    return ""


def test_job_key_travels_in_the_env_contract_only(tmp_path):
    env = _env(1234, str(tmp_path / "hb.sock"))
    assert env[C.LETO_JOB_KEY] == KEY.hex()
    ctx = Context.from_env(env)
    assert ctx.job_key == KEY and KEY.hex() not in repr(ctx)
    assert Context.from_env({k: v for k, v in env.items() if k != C.LETO_JOB_KEY}).job_key is None


def test_forged_go_key_is_reported_and_ignored_the_genuine_one_wakes(tmp_path):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    hb = HeartbeatServer(str(tmp_path / "hb.sock"))
    proc = subprocess.Popen([sys.executable, "-c", SHADOW], env=_env(server.port, hb.path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(ROOT))
    try:
        assert _line(proc, time.monotonic() + 120) == "waiting", proc.stderr.read()
        go = C.go_key(1, 1)
        server.set(go, json.dumps({"mono": 0.0}))          # what the agent writes, unsigned
        forged, deadline = None, time.monotonic() + 60
        while forged is None and time.monotonic() < deadline:
            select.select([hb.fileno()], [], [], 0.5)
            forged = next((b for b in hb.drain({proc.pid}) if b.kind == "forged"), None)
        assert forged is not None, "the shadow did not report the forged go key"
        assert json.loads(forged.detail)["key"] == go
        proc.send_signal(C.PROMOTE_SIGNAL)                  # look again now: still refused
        assert _line(proc, time.monotonic() + 2) == "" and proc.poll() is None, \
            "the shadow woke on a go key that does not verify"
        AuthStore(server, KEY).set(go, json.dumps({"mono": 1.0}))   # the agent's, signed
        proc.send_signal(C.PROMOTE_SIGNAL)
        assert _line(proc, time.monotonic() + 60) == "woke", proc.stderr.read()
        assert proc.wait(timeout=30) == 0
        assert "refused the value under 'leto/go/1/1'" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        hb.close()


def test_wait_for_promotion_needs_the_verifying_store():
    ctx = Context.from_env({C.LETO_CONTRACT_VERSION: str(C.CONTRACT_VERSION),
                            C.LETO_ROLE: "shadow", C.LETO_GENERATION: "1"})
    from leto_runtime import promotion
    raw = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=5))
    with pytest.raises(TypeError, match="worker_store"):
        promotion.wait_for_promotion(ctx, raw)
    with pytest.raises(RuntimeError, match=C.LETO_JOB_KEY):
        promotion.worker_store(dataclasses.replace(ctx, master_addr="127.0.0.1",
                                                   master_port=raw.port))
