"""Which workers the fork server may fork (`leto_run.fork_server.client.refusal`), checked
against the real environments `build_worker_env` writes: every variable that differs between
two workers of one job must be one the server lets differ (`worker_env.per_worker`), and any
other difference -- something may read it at import -- sends the worker to a plain spawn."""
import sys

from leto_run.fork_server.client import refusal
from leto_run.worker_env import (WorkerEnvSpec, WorkerIdentity, build_worker_env, shared_env)

PY = sys.executable
BASE = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "LETO_CHECKPOINT_DIR": "/ck",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONPATH": "/x"}


def worker(rank: int, **over) -> dict:
    ident = WorkerIdentity(local_rank=rank, global_rank=rank + 8, role_rank=rank + 8,
                           world_size=16, role_world_size=16, local_world_size=8,
                           group_rank=1, group_world_size=2, role_name="trainer")
    spec = dict(identity=ident, master_addr=f"10.0.0.{rank}", master_port=29500 + rank,
                restart_count=rank, max_restarts=3, run_id=f"r{rank}", use_agent_store=False,
                error_file=f"/e{rank}", signals_to_handle="SIGTERM", slot_role="shadow" if rank
                else "active", generation=rank, run_dir="/run", heartbeat_socket="/hb",
                hang_timeout=30.0, recovery="inplace", node="n", job_token="tok",
                dump_signal=10, inject_plan=({"r": rank},), sm_socket=f"/sm{rank}",
                shadow_epoch=rank, preinit_level="L2" if rank else None, job_key="k" * rank,
                checkpoint_env=(("LETO_CHECKPOINT_LOAD", f"/c{rank}"),))
    spec.update(over)
    return build_worker_env(BASE, WorkerEnvSpec(**spec))


ARGV = [PY, "-u", "train.py", "--lr", "1"]


def test_workers_that_differ_only_in_what_the_agent_sets_per_worker_are_forked():
    server = shared_env(BASE, "tok")
    assert server["LETO_JOB_TOKEN"] == "tok" and "RANK" not in server
    assert "LETO_CHECKPOINT_DIR" not in server and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in server
    for rank in (0, 1, 5):
        assert refusal(server, PY, ARGV, worker(rank)) is None
    assert refusal(server, PY, [PY, "-u", "-m", "pkg.train"], worker(2)) is None


def test_a_difference_in_a_shared_variable_is_refused_and_named():
    server = shared_env(BASE, "tok")
    changed = dict(worker(0), OMP_NUM_THREADS="4")
    assert "OMP_NUM_THREADS" in refusal(server, PY, ARGV, changed)
    dropped = {k: v for k, v in worker(0).items() if k != "PYTHONPATH"}
    assert "PYTHONPATH" in refusal(server, PY, ARGV, dropped)
    added = dict(worker(0), TORCH_LOGS="+dynamo")
    assert "TORCH_LOGS" in refusal(server, PY, ARGV, added)


def test_another_interpreter_or_no_unbuffered_flag_is_refused():
    server = shared_env(BASE, "tok")
    assert "PYTHON_EXEC" in refusal(server, PY, ["/opt/py/bin/python", "-u", "t.py"], worker(0))
    assert refusal(server, PY, [PY, "t.py"], worker(0)) is not None
    assert refusal(server, PY, ["./train.sh", "--x"], worker(0)) is not None     # --no-python
