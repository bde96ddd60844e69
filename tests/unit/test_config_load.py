"""build_config: precedence, sources in error messages, YAML checks and torchrun's resolution rules.

Pure: argv is parsed by click (`leto_run.cli.load_config`), env is a dict, YAML files live in
tmp_path.  No process is started.
"""
from __future__ import annotations

import textwrap

import pytest

from leto_run import config_load as L
from leto_run.cli import load_config
from leto_run.errors import ConfigError


@pytest.fixture
def yml(tmp_path):
    def write(text: str, name: str = "job.yaml") -> str:
        p = tmp_path / name
        p.write_text(textwrap.dedent(text).lstrip("\n"))
        return str(p)
    return write


def load(argv, env=None):
    return load_config(list(argv), env or {})


def err(argv, env=None) -> ConfigError:
    with pytest.raises(ConfigError) as ei:
        load(argv, env)
    return ei.value


# ---- precedence -------------------------------------------------------------------------------
def test_defaults(yml):
    cfg = load(["t.py"])
    assert cfg.launch.training_script == "t.py" and cfg.launch.script_args == ()
    assert cfg.launch.max_restarts == 0 and cfg.recovery.mode == "inplace"
    assert cfg.launch.shutdown_timeout == 30.0 and cfg.logs.status is None


@pytest.mark.parametrize("key, yaml_val, env_name, env_val, flag, cli_val, get, want", [
    ("launch.max_restarts", "1", "PET_MAX_RESTARTS", "2", "--max-restarts", "3",
     lambda c: c.launch.max_restarts, (1, 2, 3)),
    ("launch.nproc_per_node", "2", "PET_NPROC_PER_NODE", "3", "--nproc_per_node", "4",
     lambda c: c.launch.nproc_per_node, ("2", "3", "4")),
    ("launch.monitor_interval", "0.5", "PET_MONITOR_INTERVAL", "0.25", "--monitor-interval", "1",
     lambda c: c.launch.monitor_interval, (0.5, 0.25, 1.0)),
    ("launch.role", "a", "PET_ROLE", "b", "--role", "c", lambda c: c.launch.role, ("a", "b", "c")),
    ("logs.tee", "1", "PET_TEE", "2", "-t", "3", lambda c: c.logs.tee, ("1", "2", "3")),
    ("rendezvous.id", "y", "PET_RDZV_ID", "e", "--rdzv_id", "c", lambda c: c.rendezvous.id,
     ("y", "e", "c")),
    ("recovery.mode", "restart", "LETO_RECOVERY", "inplace", "--recovery", "restart",
     lambda c: c.recovery.mode, ("restart", "inplace", "restart")),
    ("recovery.hang_timeout", "10", "LETO_HANG_TIMEOUT", "20", "--hang-timeout", "0",
     lambda c: c.recovery.hang_timeout, (10.0, 20.0, 0.0)),
    ("launch.exit_barrier_timeout", "1", "LETO_EXIT_BARRIER_TIMEOUT", "2",
     "--exit-barrier-timeout", "3", lambda c: c.launch.exit_barrier_timeout, (1.0, 2.0, 3.0)),
    ("logs.events", "a.jsonl", "LETO_EVENTS", "b.jsonl", "--events", "c.jsonl",
     lambda c: c.logs.events, ("a.jsonl", "b.jsonl", "c.jsonl")),
    ("launch.shutdown_timeout", "5", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "6", "--shutdown-timeout",
     "7", lambda c: c.launch.shutdown_timeout, (5.0, 6.0, 7.0)),
])
def test_precedence_yaml_env_cli(yml, key, yaml_val, env_name, env_val, flag, cli_val, get, want):
    sec, name = key.split(".")
    path = yml(f"{sec}:\n  {name}: {yaml_val}\n")
    assert get(load(["--config", path, "t.py"])) == want[0]
    assert get(load(["--config", path, "t.py"], {env_name: env_val})) == want[1]
    assert get(load(["--config", path, flag, cli_val, "t.py"], {env_name: env_val})) == want[2]


def test_flags_and_bool_env():
    assert load(["t.py"], {"PET_STANDALONE": "1"}).rendezvous.standalone
    assert not load(["t.py"], {"PET_STANDALONE": "0"}).rendezvous.standalone
    assert load(["-m", "pkg.t"]).launch.module
    assert load(["pkg.t"], {"PET_MODULE": "true"}).launch.module
    assert load(["/a/t.py"], {"PET_RUN_PATH": "1"}).launch.run_path
    assert load(["t.py"], {"PET_NO_PYTHON": "1"}).launch.no_python
    e = err(["t.py"], {"PET_STANDALONE": "maybe"})
    assert (e.key, e.source) == ("rendezvous.standalone", "PET_STANDALONE")


def test_status_tristate():
    assert load(["t.py"]).logs.status is None
    assert load(["t.py"], {"LETO_STATUS": "0"}).logs.status is False
    assert load(["t.py"], {"LETO_STATUS": "auto"}).logs.status is None
    assert load(["--status", "t.py"], {"LETO_STATUS": "0"}).logs.status is True
    assert load(["--no-status", "t.py"], {"LETO_STATUS": "1"}).logs.status is False


def test_shutdown_timeout_env_order():
    env = {"PET_SHUTDOWN_TIMEOUT": "3", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "9"}
    assert load(["t.py"], env).launch.shutdown_timeout == 3.0     # PET_ beats TORCH_ELASTIC_


def test_empty_strings_mean_unset_like_torchrun():
    c = load(["--local-ranks-filter", "", "--log-dir", "", "--local-addr", "", "t.py"])
    assert c.logs.local_ranks_filter == () and c.logs.log_dir is None
    assert c.rendezvous.local_addr is None


def test_empty_env_is_unset():
    assert load(["t.py"], {"PET_NNODES": "", "PET_MAX_RESTARTS": " "}).launch.max_restarts == 0


def test_underscored_and_dashed_spellings_are_the_same_option():
    a = load(["--nproc-per-node", "2", "--max_restarts", "1", "--rdzv-conf", "join_timeout=5",
              "--master_port", "1234", "t.py"])
    b = load(["--nproc_per_node", "2", "--max-restarts", "1", "--rdzv_conf", "join_timeout=5",
              "--master-port", "1234", "t.py"])
    assert a.launch == b.launch and a.rendezvous == b.rendezvous


def test_script_args_pass_through_untouched():
    cfg = load(["--nproc-per-node", "1", "t.py", "--lr", "3", "-m", "--help", "--nnodes", "x"])
    assert cfg.launch.script_args == ("--lr", "3", "-m", "--help", "--nnodes", "x")
    assert cfg.launch.nnodes == "1:1" and not cfg.launch.module


def test_every_option_has_yaml_cli_and_env():
    pet = {o.key: o.env for o in L.OPTIONS}
    assert pet["launch.nproc_per_node"] == ("PET_NPROC_PER_NODE",)
    assert pet["launch.nnodes"] == ("PET_NNODES",) and pet["launch.max_restarts"] == ("PET_MAX_RESTARTS",)
    assert pet["rendezvous.backend"] == ("PET_RDZV_BACKEND",)
    assert pet["logs.redirects"] == ("PET_REDIRECTS",) and pet["launch.module"] == ("PET_MODULE",)
    for o in L.OPTIONS:
        sec, name = o.key.split(".")
        assert name in {f.name for f in L.dataclasses.fields(L.SECTIONS[sec])}
        if o.kind != "positional":
            assert any(f.startswith("--") for f in o.flags)


# ---- YAML --------------------------------------------------------------------------------------
def test_yaml_script_and_cli_script_wins(yml):
    path = yml("""
        launch:
          training_script: y.py
          script_args: ["--a", "1"]
    """)
    c = load(["--config", path])
    assert (c.launch.training_script, c.launch.script_args) == ("y.py", ("--a", "1"))
    c = load(["--config", path, "cli.py"])
    assert (c.launch.training_script, c.launch.script_args) == ("cli.py", ())
    c = load(["--config", path, "cli.py", "--b"])
    assert c.launch.script_args == ("--b",)


def test_leto_config_env_and_config_flag_wins(yml):
    a = yml("launch: {max_restarts: 1}\n", "a.yaml")
    b = yml("launch: {max_restarts: 2}\n", "b.yaml")
    assert load(["t.py"], {"LETO_CONFIG": a}).launch.max_restarts == 1
    assert load(["--config", b, "t.py"], {"LETO_CONFIG": a}).launch.max_restarts == 2


def test_yaml_native_types(yml):
    path = yml("""
        launch:
          nnodes: 1:4          # YAML 1.1 would read this as 64; Leto keeps the text
          nproc_per_node: 2
          signals_to_handle: [SIGTERM, usr1]
        rendezvous:
          backend: c10d
          endpoint: node0:29400
          conf: {join_timeout: 900, last_call_timeout: 30}
        logs:
          redirects: {0: 3, 1: 1}
          tee: 0:1
          local_ranks_filter: [1]
          status: false
        recovery:
          hang_timeout: null   # null = the default
    """)
    c = load(["--config", path, "t.py"])
    assert (c.launch.min_nodes, c.launch.max_nodes) == (1, 4)
    assert c.launch.signals_to_handle == ("SIGTERM", "SIGUSR1")
    assert c.rendezvous.conf == (("join_timeout", "900"), ("last_call_timeout", "30"))
    assert c.logs.redirects == "0:3,1:1" and c.logs.tee == "0:1"
    assert c.logs.local_ranks_filter == (1,) and c.logs.status is False
    assert c.recovery.hang_timeout == 60.0


@pytest.mark.parametrize("text, key, line, words", [
    ("launch:\n  nprocs_per_node: 2\n", "launch.nprocs_per_node", 2,
     ["unknown key", "did you mean 'nproc_per_node'"]),
    ("launch:\n  nproc_per_node: 2\nrdzv:\n  backend: c10d\n", "rdzv", 3,
     ["unknown section", "did you mean 'rendezvous'"]),
    ("rendezvous:\n  rdzv_backend: c10d\n", "rendezvous.rdzv_backend", 2,
     ["did you mean 'backend'"]),
    ("rendezvous:\n  nproc_per_node: 2\n", "rendezvous.nproc_per_node", 2,
     ["did you mean 'launch.nproc_per_node'"]),
    ("launch:\n  max_nodes: 2\n", "launch.max_nodes", 2, ["derived", "launch.nnodes"]),
    ("nproc_per_node: 2\n", "nproc_per_node", 1, ["did you mean 'launch.nproc_per_node'"]),
    ("launch:\n  role: [a]\n", "launch.role", 2, ["expected a string", "give launch.role as NAME"]),
    ("launch:\n  nnodes: [1, 2]\n", "launch.nnodes", 2, ["expected a string"]),
    ("launch:\n  max_restarts: three\n", "launch.max_restarts", 2, ["'three' is not an integer"]),
    # YAML text is read as the CLI reads it (yaml_source._Loader): `true` is not an integer
    ("launch:\n  max_restarts: true\n", "launch.max_restarts", 2, ["'true' is not an integer"]),
    ("launch:\n  script_args: [--epochs, [3]]\n", "launch.script_args", 2, ["quote it"]),
    ("launch:\n  script_args: --epochs\n", "launch.script_args", 2, ["list of strings"]),
    ("rendezvous:\n  standalone: 3\n", "rendezvous.standalone", 2, ["not a boolean"]),
    ("launch:\n  nproc_per_node: 2\n\n  nproc_per_node: 3\n", "launch.nproc_per_node", 4,
     ["duplicate key", "line 2"]),
    ("launch: 3\n", "launch", 1, ["expected a mapping"]),
    ("launch:\n  nnodes: 4:2\n", "launch.nnodes", 2, ["MIN=4, MAX=2"]),
    ("logs:\n  redirects: 7\n", "logs.redirects", 2, ["stream selector"]),
    ("logs:\n  local_ranks_filter: a,b\n", "logs.local_ranks_filter", 2, ["'a'"]),
    ("recovery:\n  hang_timeout: -5\n", "recovery.hang_timeout", 2, [">= 0"]),
    ("launch:\n  nproc_per_node: 2\n  max_restarts: 0\ninject:\n  - kill:rank=0:after=1\n"
     "  - kill:rank=2:after=1\n", "inject[1]", 6, ["world size 2"]),
    ("inject:\n  - kil:rank=0:after=1\n", "inject[0]", 2, ["did you mean 'kill'"]),
    ("inject:\n  - {kind: kill, rank: 0}\n", "inject[0]", 2, ["trigger"]),
    ("inject:\n  - [3]\n", "inject[0]", 2, ["neither a spec string nor a mapping"]),
    ("inject: kill:rank=0:after=1\n", "inject", 1, ["expected a list"]),
])
def test_yaml_rejects_with_file_and_line(yml, text, key, line, words):
    path = yml(text)
    e = err(["--config", path, "t.py"])
    assert e.key == key and e.source == f"{path}:{line}", str(e)
    assert e.fix
    for w in words:
        assert w in str(e), str(e)


@pytest.mark.parametrize("text, words", [
    ("- a\n- b\n", ["list, not a mapping"]),
    ("just text\n", ["str, not a mapping"]),
    ("launch:\n  nnodes: [1, 2\n", ["YAML syntax error"]),
    ("launch:\n\tnnodes: 2\n", ["YAML syntax error"]),
])
def test_yaml_document_rejects(yml, text, words):
    path = yml(text)
    e = err(["--config", path, "t.py"])
    assert e.key == "config" and e.source.startswith(path)
    for w in words:
        assert w in str(e)


def test_yaml_missing_file_and_empty_file(yml, tmp_path):
    e = err(["--config", str(tmp_path / "nope.yaml"), "t.py"])
    assert (e.key, e.source) == ("config", "--config") and "cannot read" in e.problem
    e = err(["t.py"], {"LETO_CONFIG": str(tmp_path / "nope.yaml")})
    assert e.source == "LETO_CONFIG"
    assert load(["--config", yml("# only a comment\n"), "t.py"]).launch.nnodes == "1:1"


def test_yaml_inject_strings_and_mappings_and_cli_replaces(yml):
    path = yml("""
        launch: {nproc_per_node: 4}
        inject:
          - kill:rank=1:after=5s
          - {kind: signal, signal: SIGSEGV, rank: 2, step: 20, attempt: 0}
    """)
    c = load(["--config", path, "t.py"])
    assert [s.text for s in c.inject] == ["kill:rank=1:after=5s", "signal=SIGSEGV:rank=2:step=20"]
    c = load(["--config", path, "--inject", "hang:rank=3:step=1", "t.py"])
    assert [s.text for s in c.inject] == ["hang:rank=3:step=1"]


def test_yaml_anchor_and_merge_keys(yml):
    path = yml("""
        launch: &l
          nproc_per_node: 2
        logs:
          local_ranks_filter: [0, 1]
    """)
    assert load(["--config", path, "t.py"]).logs.local_ranks_filter == (0, 1)


# ---- sources of non-YAML errors ---------------------------------------------------------------
@pytest.mark.parametrize("argv, env, key, source", [
    (["--nnodes", "4:2", "t.py"], {}, "launch.nnodes", "--nnodes"),
    (["t.py"], {"PET_NNODES": "0"}, "launch.nnodes", "PET_NNODES"),
    (["--nnodes", "x", "t.py"], {}, "launch.nnodes", "--nnodes"),
    (["--max-restarts", "-1", "t.py"], {}, "launch.max_restarts", "--max-restarts"),
    (["--max_restarts", "x", "t.py"], {}, "launch.max_restarts", "--max-restarts"),
    (["--shutdown-timeout", "-1", "t.py"], {}, "launch.shutdown_timeout", "--shutdown-timeout"),
    (["t.py"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "-1"}, "launch.shutdown_timeout",
     "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"),
    (["--monitor-interval", "0", "t.py"], {}, "launch.monitor_interval", "--monitor-interval"),
    (["--nproc-per-node", "0", "t.py"], {}, "launch.nproc_per_node", "--nproc-per-node"),
    (["--nproc-per-node", "abc", "t.py"], {}, "launch.nproc_per_node", "--nproc-per-node"),
    (["--nproc-per-node", "2", "--inject", "kill:rank=2:after=1s", "t.py"], {}, "inject[0]",
     "--inject"),
    (["--nnodes", "2", "--nproc-per-node", "2", "--inject", "kill:rank=0:after=1",
      "--inject", "kill:rank=4:after=1", "t.py"], {}, "inject[1]", "--inject"),
    (["--no-python", "-m", "pkg.t"], {}, "launch.module", "--module"),
    (["--run-path", "t.py"], {}, "launch.run_path", "--run-path"),
    (["--rdzv-backend", "bogus", "t.py"], {}, "rendezvous.backend", "--rdzv-backend"),
    (["t.py"], {"PET_RDZV_BACKEND": "bogus"}, "rendezvous.backend", "PET_RDZV_BACKEND"),
    (["--redirects", "7", "t.py"], {}, "logs.redirects", "--redirects"),
    (["-r", "0:1,1", "t.py"], {}, "logs.redirects", "--redirects"),
    (["-t", "0:9", "t.py"], {}, "logs.tee", "--tee"),
    (["--nproc-per-node", "2", "-r", "0:1,3:1", "t.py"], {}, "logs.redirects", "--redirects"),
    (["--local-ranks-filter", "a,b", "t.py"], {}, "logs.local_ranks_filter",
     "--local-ranks-filter"),
    (["--local-ranks-filter", "0,,1", "t.py"], {}, "logs.local_ranks_filter",
     "--local-ranks-filter"),
    (["--signals-to-handle", "SIGTERM,SIGBOGUS", "t.py"], {}, "launch.signals_to_handle",
     "--signals-to-handle"),
    (["--signals-to-handle", "SIGKILL", "t.py"], {}, "launch.signals_to_handle",
     "--signals-to-handle"),
    (["--signals-to-handle", "SIGSTOP", "t.py"], {}, "launch.signals_to_handle",
     "--signals-to-handle"),
    (["--standalone", "--nnodes", "2", "t.py"], {}, "rendezvous.standalone", "--standalone"),
    (["--standalone", "--rdzv-endpoint", "h:1", "t.py"], {}, "rendezvous.endpoint",
     "--rdzv-endpoint"),
    (["--standalone", "--rdzv-backend", "etcd", "t.py"], {}, "rendezvous.backend",
     "--rdzv-backend"),
    (["--hang-timeout", "-5", "t.py"], {}, "recovery.hang_timeout", "--hang-timeout"),
    (["t.py"], {"LETO_HANG_TIMEOUT": "soon"}, "recovery.hang_timeout", "LETO_HANG_TIMEOUT"),
    (["--recovery", "fast", "t.py"], {}, "recovery.mode", "--recovery"),
    (["--master-port", "0", "t.py"], {}, "rendezvous.master_port", "--master-port"),
    (["--rdzv-conf", "join_timeout", "t.py"], {}, "rendezvous.conf", "--rdzv-conf"),
    (["--rdzv-conf", "rank=3", "--master-port", "1", "t.py"], {}, "rendezvous.conf",
     "--rdzv-conf"),
    (["--nnodes", "2", "--node-rank", "2", "t.py"], {}, "launch.node_rank", "--node-rank"),
    (["--node-rank", "1", "t.py"], {}, "launch.node_rank", "--node-rank"),
    (["--recovery", "restart", "--inject", "kill:rank=0:after=1:attempt=1", "t.py"], {},
     "inject[0]", "--inject"),
    (["--numa-binding", "node", "t.py"], {}, "launch.numa_binding", "--numa-binding"),
    (["--virtual-local-rank", "t.py"], {}, "launch.virtual_local_rank", "--virtual-local-rank"),
    (["--event-log-handler", "console", "t.py"], {}, "logs.event_log_handler",
     "--event-log-handler"),
    (["--logs-specs", "x", "t.py"], {}, "logs.logs_specs", "--logs-specs"),
    (["--duplicate-stdout-filters", "a,,b", "t.py"], {}, "logs.duplicate_stdout_filters",
     "--duplicate-stdout-filters"),
    (["--duplicate_stderr_filters", "x", "t.py"], {}, "logs.duplicate_stderr_filters",
     "--duplicate-stderr-filters"),
    ([], {}, "launch.training_script", "command line"),
])
def test_rejects_name_key_and_source(argv, env, key, source):
    e = err(argv, env)
    assert (e.key, e.source) == (key, source), str(e)
    assert e.problem and e.fix


def test_unsupported_defaults_given_explicitly_are_fine():
    c = load(["--event-log-handler", "null", "--duplicate-stdout-filters", "", "t.py"])
    assert c.logs.event_log_handler == "null" and c.logs.duplicate_stdout_filters == ()


def test_conv_filters_escape():
    assert L.conv_filters("a,,b,c") == ("a,b", "c")


# ---- torchrun's resolution rules --------------------------------------------------------------
def build(argv, env=None):
    from leto_run.cli import cli
    ctx = cli.make_context("leto-run", list(argv))
    given = {n for n in ctx.params if ctx.get_parameter_source(n).name == "COMMANDLINE"}
    return L.build_config(ctx.params, given, env or {}, ctx.params["config"],
                          new_id=lambda: "RANDOM-ID")


def test_standalone_resolves_to_c10d_free_port():
    rz = build(["--standalone", "--nproc-per-node", "2", "t.py"]).rendezvous
    assert (rz.backend, rz.endpoint, rz.id, rz.standalone, rz.auto_c10d) == \
        ("c10d", "localhost:0", "RANDOM-ID", True, False)
    assert rz.conf == () and rz.master_port == 29500
    assert build(["--standalone", "--rdzv-id", "mine", "t.py"]).rendezvous.id == "mine"
    assert build(["--standalone", "--rdzv-backend", "c10d", "t.py"]).rendezvous.backend == "c10d"


def test_single_node_static_without_port_switches_to_c10d():
    rz = build(["t.py"]).rendezvous
    assert (rz.backend, rz.endpoint, rz.id, rz.auto_c10d) == ("c10d", "localhost:0", "RANDOM-ID", True)


@pytest.mark.parametrize("argv, env", [
    (["--master-port", "1234", "t.py"], {}),
    (["t.py"], {"PET_MASTER_PORT": "1234"}),
])
def test_master_port_keeps_static(argv, env):
    rz = build(argv, env).rendezvous
    assert (rz.backend, rz.endpoint, rz.master_port, rz.auto_c10d) == \
        ("static", "127.0.0.1:1234", 1234, False)
    assert rz.conf == (("rank", "0"),) and rz.rdzv_configs() == {"rank": 0}


def test_multinode_static_defaults_port_and_puts_node_rank_in_conf():
    c = build(["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
               "--rdzv-conf", "timeout=60", "t.py"])
    rz = c.rendezvous
    assert (rz.backend, rz.endpoint, rz.master_port) == ("static", "10.0.0.1:29500", 29500)
    assert rz.conf == (("timeout", "60"), ("rank", "1"))
    assert c.warnings == ()


def test_static_with_endpoint_keeps_it():
    rz = build(["--nnodes", "2", "--rdzv-endpoint", "h0:5000", "t.py"]).rendezvous
    assert (rz.backend, rz.endpoint, rz.conf) == ("static", "h0:5000", (("rank", "0"),))


def test_c10d_multinode_and_warnings():
    c = build(["--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h0:29400",
               "--rdzv-id", "job7", "--master-addr", "10.1.1.1", "--node-rank", "3", "t.py"])
    rz = c.rendezvous
    assert (rz.backend, rz.endpoint, rz.id, rz.conf) == ("c10d", "h0:29400", "job7", ())
    assert len(c.warnings) == 2 and all("static" in w for w in c.warnings)


def test_run_path_with_no_python_warns():
    assert "precedence" in build(["--run-path", "--no-python", "/a/t.py"]).warnings[0]
