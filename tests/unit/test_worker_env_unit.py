"""The env writer and reader agree (round trip through the contract), without processes."""
import pytest

from leto_runtime.context import ContractError
from leto_run.worker_env import WorkerEnvSpec, WorkerIdentity, build_worker_env, default_omp_threads
from leto_runtime import Context
from leto_runtime.wire import contract as C


def spec(**kw):
    ident = WorkerIdentity(local_rank=1, global_rank=5, role_rank=5, world_size=8, role_world_size=8,
                           local_world_size=4, group_rank=1, group_world_size=2, role_name="default")
    base = dict(identity=ident, master_addr="h", master_port=1234, restart_count=2, max_restarts=3,
                run_id="rid", use_agent_store=True, error_file="/e.json",
                signals_to_handle="SIGTERM,SIGINT", slot_role="active", generation=4, run_dir="/r",
                heartbeat_socket="/r/hb.sock", hang_timeout=7.5, recovery="restart", node="n",
                job_token="tok", dump_signal=C.DUMP_SIGNAL,
                inject_plan=({"kind": "kill", "rank": 5, "step": 3, "signal": 9, "text": "kill:rank=5:step=3"},))
    base.update(kw)
    return WorkerEnvSpec(**base)


def test_round_trip():
    env = build_worker_env({"PATH": "/bin"}, spec())
    assert env["PATH"] == "/bin" and env["RANK"] == "5" and env["LOCAL_RANK"] == "1"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    ctx = Context.from_env(env)
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.restart_count) == (5, 1, 8, 2)
    assert ctx.under_leto and ctx.generation == 4 and ctx.hang_timeout == 7.5
    assert ctx.inject_plan[0]["step"] == 3


def test_user_nccl_setting_is_kept():
    env = build_worker_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, spec())
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_plain_torchrun_env_reads_as_not_leto():
    ctx = Context.from_env({"RANK": "0", "WORLD_SIZE": "1"})
    assert not ctx.under_leto and ctx.inject_plan == ()


def test_omp_rule():
    env = {}
    assert default_omp_threads(env, 1) is None and env == {}
    assert default_omp_threads(env, 2) and env["OMP_NUM_THREADS"] == "1"
    env2 = {"OMP_NUM_THREADS": "4"}
    assert default_omp_threads(env2, 8) is None and env2["OMP_NUM_THREADS"] == "4"


def test_checkpoint_settings_round_trip_and_the_agent_s_own_never_leak():
    from leto_run.config_checkpoint import CheckpointConfig, worker_env
    cfg = CheckpointConfig(dir="/ck", every="5")
    agent_env = {"PATH": "/bin", "LETO_CHECKPOINT_DIR": "/elsewhere",
                 "LETO_CHECKPOINT_EVERY": "9", "LETO_CHECKPOINT_LOAD": "/stale"}
    env = build_worker_env(agent_env, spec(checkpoint_env=worker_env(cfg, None)))
    assert "LETO_CHECKPOINT_EVERY" not in env and C.LETO_CHECKPOINT_LOAD not in env
    ck = Context.from_env(env).checkpoint
    assert (ck.directory, ck.every_steps, ck.every_s, ck.ff_mtbf, ck.keep) == ("/ck", 5, 0, 0, 2)
    env = build_worker_env(agent_env, spec(checkpoint_env=worker_env(CheckpointConfig(), "/l")))
    ctx = Context.from_env(env)
    assert ctx.checkpoint is None and ctx.checkpoint_load == "/l"


def test_a_shadow_s_warm_up_room_round_trips_and_never_leaks():
    env = build_worker_env({"PATH": "/bin"}, spec(slot_role="shadow", warmup_room=5 << 30))
    assert Context.from_env(env).warmup_room == 5 << 30
    # an active (or a shadow without the agent's view) gets none, even from the agent's own env
    env = build_worker_env({C.LETO_WARMUP_ROOM: "123"}, spec())
    assert C.LETO_WARMUP_ROOM not in env and Context.from_env(env).warmup_room is None
    with pytest.raises(ContractError, match=C.LETO_WARMUP_ROOM):
        Context.from_env({**build_worker_env({}, spec()), C.LETO_WARMUP_ROOM: "lots"})
