"""The config dataclasses on their own: defaults, normalization, and every check in __post_init__."""
from __future__ import annotations

import dataclasses

import pytest

from leto_run import config as C
from leto_run.config import JobConfig, LaunchConfig, LogsConfig, RecoveryConfig, RendezvousConfig
from leto_run.errors import ConfigError
from leto_run.inject import parse_inject


def test_defaults_are_valid_and_frozen():
    cfg = JobConfig()
    assert cfg.launch.nproc_per_node == "1" and cfg.launch.min_nodes == cfg.launch.max_nodes == 1
    assert cfg.rendezvous.master_port == 29500 and cfg.rendezvous.backend == "static"
    assert cfg.max_world_size == 1 and cfg.warnings == () and cfg.inject == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.launch.nnodes = "2"  # type: ignore[misc]


def test_normalization():
    la = LaunchConfig(nnodes="1:4", nproc_per_node=" 08 ", script_args=["a", "b"],
                      signals_to_handle=("term", "SIGUSR1", "15", "SIGTERM"))
    assert (la.min_nodes, la.max_nodes) == (1, 4)
    assert la.nproc_per_node == "8" and la.nproc_int == 8
    assert la.script_args == ("a", "b")
    assert la.signals_to_handle == ("SIGTERM", "SIGUSR1")         # names, deduplicated
    assert LaunchConfig(nproc_per_node="GPU").nproc_per_node == "gpu"
    assert LaunchConfig(nproc_per_node="auto").nproc_int is None
    lg = LogsConfig(redirects=" 3", tee="0:1,1:2", local_ranks_filter=[1, 0, 1])
    assert lg.redirects == "3" and lg.std_map("tee") == {0: 1, 1: 2}
    assert lg.local_ranks_filter == (1, 0)


@pytest.mark.parametrize("kwargs, key, words", [
    (dict(nnodes="4:2"), "launch.nnodes", ["MIN=4, MAX=2", "2:4"]),
    (dict(nnodes="0"), "launch.nnodes", ["1 <= MIN"]),
    (dict(nnodes="1:2:3"), "launch.nnodes", ["N or MIN:MAX"]),
    (dict(nnodes="two"), "launch.nnodes", ["N or MIN:MAX"]),
    (dict(nnodes="1:2", min_nodes=2, max_nodes=3), "launch.nnodes", ["contradicts"]),
    (dict(nproc_per_node="0"), "launch.nproc_per_node", ["'0'"]),
    (dict(nproc_per_node="abc"), "launch.nproc_per_node", ["'abc'", "auto/cpu/gpu"]),
    (dict(nproc_per_node="-2"), "launch.nproc_per_node", ["'-2'"]),
    (dict(nproc_per_node="xpu"), "launch.nproc_per_node", ["'xpu'"]),
    (dict(node_rank=-1), "launch.node_rank", ["-1"]),
    (dict(max_restarts=-1), "launch.max_restarts", ["-1", ">= 0"]),
    (dict(max_restarts=1.5), "launch.max_restarts", ["1.5"]),
    (dict(monitor_interval=0), "launch.monitor_interval", ["> 0"]),
    (dict(monitor_interval=float("nan")), "launch.monitor_interval", ["nan"]),
    (dict(shutdown_timeout=-1), "launch.shutdown_timeout", [">= 0"]),
    (dict(exit_barrier_timeout=-0.5), "launch.exit_barrier_timeout", [">= 0"]),
    (dict(start_method="thread"), "launch.start_method", ["spawn, fork, forkserver"]),
    (dict(role=" "), "launch.role", ["empty"]),
    (dict(module=True, no_python=True, training_script="pkg.mod"), "launch.module",
     ["--no-python"]),
    (dict(module=True, run_path=True, training_script="/abs/x.py"), "launch.module", ["--run-path"]),
    (dict(module=True, training_script="train.py"), "launch.module", ["module name", "-m train"]),
    (dict(run_path=True, training_script="train.py"), "launch.run_path", ["absolute", "train.py"]),
    (dict(signals_to_handle=("SIGFOO",)), "launch.signals_to_handle", ["SIGFOO"]),
    (dict(signals_to_handle=("SIGKILL",)), "launch.signals_to_handle", ["cannot be caught"]),
    (dict(signals_to_handle=("STOP",)), "launch.signals_to_handle", ["SIGSTOP cannot"]),
    (dict(signals_to_handle=("SIGSEGV",)), "launch.signals_to_handle", ["not forwarded"]),
    (dict(signals_to_handle=()), "launch.signals_to_handle", ["empty"]),
    (dict(script_args=("a", 3)), "launch.script_args", ["non-strings"]),
    (dict(numa_binding="bogus"), "launch.numa_binding", ["not a NUMA mode"]),
    (dict(numa_binding="node"), "launch.numa_binding", ["not supported", "numactl"]),
    (dict(virtual_local_rank=True), "launch.virtual_local_rank", ["not supported"]),
])
def test_launch_rejects(kwargs, key, words):
    with pytest.raises(ConfigError) as ei:
        LaunchConfig(**kwargs)
    assert ei.value.key == key and ei.value.fix
    for w in words:
        assert w in str(ei.value), str(ei.value)


def test_launch_accepts_edge_cases():
    LaunchConfig(module=True, training_script="pkg.train")
    LaunchConfig(run_path=True, training_script="/abs/train.py", no_python=True)
    LaunchConfig(run_path=True)                        # script comes later (YAML/CLI); not checked
    LaunchConfig(signals_to_handle=C.FORWARDABLE_SIGNALS)
    LaunchConfig(shutdown_timeout=0, exit_barrier_timeout=0)


@pytest.mark.parametrize("cls, kwargs, key", [
    (RendezvousConfig, dict(backend="bogus"), "rendezvous.backend"),
    (RendezvousConfig, dict(backend="C10D"), "rendezvous.backend"),
    (RendezvousConfig, dict(endpoint="host:99999"), "rendezvous.endpoint"),
    (RendezvousConfig, dict(endpoint="a b:1"), "rendezvous.endpoint"),
    (RendezvousConfig, dict(id=""), "rendezvous.id"),
    (RendezvousConfig, dict(conf=(("join_timeout", "soon"),)), "rendezvous.conf"),
    (RendezvousConfig, dict(conf=(("join_timeout", "-1"),)), "rendezvous.conf"),
    (RendezvousConfig, dict(conf=(("a", "1"), ("a", "2"))), "rendezvous.conf"),
    (RendezvousConfig, dict(master_addr=""), "rendezvous.master_addr"),
    (RendezvousConfig, dict(master_port=0), "rendezvous.master_port"),
    (RendezvousConfig, dict(master_port=70000), "rendezvous.master_port"),
    (RendezvousConfig, dict(master_port="29500"), "rendezvous.master_port"),
    (RendezvousConfig, dict(local_addr=" "), "rendezvous.local_addr"),
    (LogsConfig, dict(redirects="7"), "logs.redirects"),
    (LogsConfig, dict(tee="0:1,x"), "logs.tee"),
    (LogsConfig, dict(tee="0:4"), "logs.tee"),
    (LogsConfig, dict(redirects="0:1,0:2"), "logs.redirects"),
    (LogsConfig, dict(local_ranks_filter=(-1,)), "logs.local_ranks_filter"),
    (LogsConfig, dict(log_dir=""), "logs.log_dir"),
    (LogsConfig, dict(status="yes"), "logs.status"),
    (LogsConfig, dict(event_log_handler="console"), "logs.event_log_handler"),
    (LogsConfig, dict(logs_specs="mine"), "logs.logs_specs"),
    (LogsConfig, dict(duplicate_stdout_filters=("x",)), "logs.duplicate_stdout_filters"),
    (LogsConfig, dict(duplicate_stderr_filters=("x",)), "logs.duplicate_stderr_filters"),
    (RecoveryConfig, dict(mode="fast"), "recovery.mode"),
    (RecoveryConfig, dict(hang_timeout=-5), "recovery.hang_timeout"),
    (RecoveryConfig, dict(hang_timeout=float("inf")), "recovery.hang_timeout"),
])
def test_section_rejects(cls, kwargs, key):
    with pytest.raises(ConfigError) as ei:
        cls(**kwargs)
    assert ei.value.key == key and ei.value.fix


def test_rendezvous_helpers():
    rz = RendezvousConfig(endpoint="[::1]:29400", conf=(("join_timeout", "900"), ("rank", "2")))
    assert rz.conf_dict() == {"join_timeout": "900", "rank": "2"}
    assert rz.rdzv_configs() == {"join_timeout": "900", "rank": 2}   # static rank is an int
    assert C.parse_endpoint("node0:29400") == ("node0", 29400)
    assert C.parse_endpoint("node0") == ("node0", None)


@pytest.mark.parametrize("kwargs, key, words", [
    (dict(launch=LaunchConfig(nnodes="2"), rendezvous=RendezvousConfig(standalone=True)),
     "rendezvous.standalone", ["single-node"]),
    (dict(launch=LaunchConfig(nnodes="2", node_rank=2)), "launch.node_rank", ["0..1"]),
    (dict(launch=LaunchConfig(nproc_per_node="2"), logs=LogsConfig(redirects="0:1,2:3")),
     "logs.redirects", ["[2]"]),
    (dict(launch=LaunchConfig(nproc_per_node="2"), logs=LogsConfig(local_ranks_filter=(0, 5))),
     "logs.local_ranks_filter", ["[5]"]),
    (dict(launch=LaunchConfig(nnodes="1:2", nproc_per_node="2"),
          inject=(parse_inject("kill:rank=4:after=1"),)), "inject[0]", ["world size 4", "0..3"]),
    (dict(launch=LaunchConfig(max_restarts=1), recovery=RecoveryConfig(mode="restart"),
          inject=(parse_inject("kill:rank=0:after=1:attempt=2"),)), "inject[0]",
     ["never happens"]),
    (dict(inject=("kill:rank=0:after=1",)), "inject[0]", ["not an InjectSpec"]),
])
def test_job_cross_checks(kwargs, key, words):
    with pytest.raises(ConfigError) as ei:
        JobConfig(**kwargs)
    assert ei.value.key == key
    for w in words:
        assert w in str(ei.value), str(ei.value)


def test_job_cross_checks_pass():
    # world size unknown for nproc=gpu: rank range cannot be checked, so it is not
    JobConfig(launch=LaunchConfig(nproc_per_node="gpu"), inject=[parse_inject("kill:rank=99:after=1")])
    # in-place mode: attempt counts generations, not bounded by max_restarts
    JobConfig(inject=(parse_inject("kill:rank=0:after=1:attempt=3"),))
    # node_rank only bounds static rendezvous
    JobConfig(launch=LaunchConfig(node_rank=3), rendezvous=RendezvousConfig(backend="c10d"))


def test_to_dict_is_plain():
    d = JobConfig(inject=(parse_inject("kill:rank=0:after=1"),)).to_dict()
    assert d["launch"]["signals_to_handle"] == ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"]
    assert d["rendezvous"]["conf"] == {} and d["inject"] == ["kill:rank=0:after=1s"]
    assert set(d) == {"launch", "rendezvous", "logs", "recovery", "checkpoint", "inject",
                      "warnings"}
