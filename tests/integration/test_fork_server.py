"""Workers forked by the fork server are the processes a plain spawn would start.

The independent expectations: the interpreter itself (`python -u <args>` run directly, for
every form of command line torchrun builds, and for how a script ends), a plain spawn
(`LETO_FORK_SERVER=0`) and torchrun (the same probe script, side by side).  Only the preloaded
torch (the point of the fork server) may differ.
"""
import json
import os
import signal
import subprocess
import sys

import pytest

from leto_testing import SCRIPTS, ROOT, base_env, events, leto_cmd, of, run, torchrun_cmd
from leto_testing import assert_nothing_left
from leto_run.procs import RESET_SIGNALS

FACTS = r'''import sys, os, json, signal
print("PRELOADED=%s" % ("torch" in sys.modules))
m = sys.modules["__main__"]
spec = getattr(m, "__spec__", None)
print(json.dumps({
    "argv": sys.argv, "path": sys.path, "name": __name__, "file": vars(m).get("__file__"),
    "globals": sorted(k for k in vars(m) if k.startswith("__")),
    "loader": getattr(vars(m).get("__loader__"), "__name__", type(vars(m).get("__loader__")).__name__),
    "spec": None if spec is None else [spec.name, spec.origin], "cached": vars(m).get("__cached__"),
    "package": vars(m).get("__package__"), "cwd": os.getcwd(), "env": dict(os.environ),
    "fds": sorted(int(f) for f in os.listdir("/proc/self/fd") if os.path.exists("/proc/self/fd/" + f)),
    "signals": {s.name: str(signal.getsignal(s)) for s in signal.Signals},
    "blocked": sorted(map(int, signal.pthread_sigmask(signal.SIG_BLOCK, []))),
    "write_through": sys.stdout.write_through, "flags": list(sys.flags),
}, sort_keys=True))
'''
FILES = {
    "real/s.py": FACTS,
    "pkg/__init__.py": "",
    "pkg/mod.py": FACTS,
    "pkg/boom.py": "def f():\n    raise RuntimeError('in a module')\nf()\n",
    "app/__main__.py": FACTS,
    "bad.py": "print('never')\ndef (\n",
    "raise.py": ("import atexit\natexit.register(lambda: print('atexit ran'))\n"
                 "print('partial', end='')\ntry:\n    {}['k']\nexcept KeyError as e:\n"
                 "    raise ValueError('boom') from e\n"),
    "exit3.py": "import sys\nprint('out')\nsys.exit(3)\n",
    "exitmsg.py": "import sys\nsys.exit('a message')\n",
    "kbint.py": ("import atexit\natexit.register(lambda: print('atexit ran'))\n"
                 "raise KeyboardInterrupt\n"),
    # a file left open: the interpreter's finalization flushes it (a worker's exit must be the
    # interpreter's own, not an os._exit); the next case reads its size back
    "unclosed.py": "f = open('unclosed.txt', 'w')\nfor _ in range(1000):\n    f.write('x' * 99)\n",
    "readback.py": "import os\nprint(os.path.getsize('unclosed.txt'))\n",
}
CASES = [
    ["real/s.py", "a", "b"], ["d/../link.py", "x"], ["-m", "pkg.mod", "y"],
    ["-c", FACTS, "z"], ["app"], ["missing.py"], ["bad.py"], ["raise.py"], ["exit3.py"],
    ["exitmsg.py"], ["kbint.py"], ["-m", "pkg.boom"], ["unclosed.py"], ["readback.py"],
]


@pytest.mark.parametrize("mode", ["exec", "inherit"])
def test_a_forked_worker_runs_its_command_line_as_the_interpreter_does(tmp_path, mode):
    """exec: the server imports torch itself; inherit: it is a fork of a ``python -u``
    process that imported torch (the re-executed agent's case)."""
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "d").mkdir()
    (tmp_path / "link.py").symlink_to(tmp_path / "real" / "s.py")
    env = base_env()
    p = subprocess.run([sys.executable, "-u", str(SCRIPTS / "forkserver_driver.py"),
                        json.dumps(CASES), mode], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    forked = json.loads(p.stdout)
    for args, got in zip(CASES, forked):
        want = subprocess.run([sys.executable, "-u", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60,
                              preexec_fn=_as_the_agent_spawns)
        pre_got, pre_want = ("PRELOADED=True" in got["stdout"]), ("PRELOADED=True" in want.stdout)
        if "PRELOADED=" in want.stdout:
            assert pre_got and not pre_want, (args, "the worker was not forked from the server")
        assert (got["rc"], got["stdout"].replace("PRELOADED=True", "PRELOADED=False"),
                got["stderr"]) == (want.returncode, want.stdout, want.stderr), \
            (args, _differences(got["stdout"], want.stdout), got["stderr"][-800:],
             want.stderr[-800:])


def _as_the_agent_spawns() -> None:
    """The interpreter as the agent execs a worker: the signals it resets at their defaults,
    none blocked -- not what this test process inherited (under `nohup`, SIGHUP ignored)."""
    for s in RESET_SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _differences(got: str, want: str):
    """The facts that differ (key: (forked, exec'd)), or the raw lines where not JSON."""
    def facts(text):
        lines = text.splitlines()
        try:
            return json.loads(lines[-1]) if lines else {}
        except ValueError:
            return {"raw": lines}
    g, w = facts(got), facts(want)
    if not isinstance(g, dict) or not isinstance(w, dict):
        return g, w
    out = {}
    for k in sorted(set(g) | set(w)):
        a, b = g.get(k), w.get(k)
        if a != b and isinstance(a, dict) and isinstance(b, dict):
            out[k] = {i: (a.get(i), b.get(i)) for i in sorted(set(a) | set(b)) if a.get(i) != b.get(i)}
        elif a != b:
            out[k] = (a, b)
    return out


VALUE_MAY_DIFFER = {"TORCHELASTIC_RUN_ID", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "OUT_DIR"}
RUN_SPECIFIC = VALUE_MAY_DIFFER | {"LETO_RUN_DIR", "LETO_HEARTBEAT_SOCKET", "LETO_JOB_TOKEN", "LETO_JOB_KEY",
                                   "LETO_SM_SOCKET", "LETO_EXIT_NOTICE_FD", "LETO_EXIT_FENCE_FD"}
SAME_AS_TORCHRUN = ("cmdline", "argv", "path", "file", "name", "main_globals", "loader", "spec", "cached",
                    "cwd", "signals", "blocked", "rlimits", "umask", "nice", "affinity",
                    "write_through",
                    "flags")


def _probe(tmp_path, name, cmd, **env):
    out = tmp_path / name
    out.mkdir()
    r = run(cmd("--nproc-per-node", "2", str(SCRIPTS / "procprobe.py")), base_env(out, **env))
    assert r.returncode == 0, r.stderr[-3000:]
    return {p.name: json.loads(p.read_text()) for p in out.glob("probe_*.json")}


def test_workers_under_leto_run_are_the_processes_a_plain_spawn_and_torchrun_start(tmp_path):
    ev = tmp_path / "ev.jsonl"
    forked = _probe(tmp_path, "fork", lambda *a: leto_cmd("--no-status", "--events", str(ev), *a))
    plain = _probe(tmp_path, "plain", lambda *a: leto_cmd("--no-status", *a), LETO_FORK_SERVER="0")
    ref = _probe(tmp_path, "torchrun", torchrun_cmd)
    assert sorted(forked) == sorted(plain) == sorted(ref) == ["probe_0_0.json", "probe_1_0.json"]
    for f in ref:
        a, b, t = forked[f], plain[f], ref[f]
        assert a.pop("torch_preloaded") and not b.pop("torch_preloaded")
        assert not t.pop("torch_preloaded")
        for k in SAME_AS_TORCHRUN:
            assert a[k] == b[k] == t[k], (f, k)
        ea, eb = a.pop("env"), b.pop("env")
        eb.pop("LETO_FORK_SERVER")                  # the knob of the plain run itself
        # A forked worker armed its exit notice before the script (as leto_runtime's import
        # does): the page's fd is mapped and closed, its variable gone; the plain worker's
        # script never imports leto_runtime, so its notice stays unarmed.
        assert "LETO_EXIT_NOTICE_FD" not in ea and "LETO_EXIT_NOTICE_FD" in eb, f
        notice_fd = eb.pop("LETO_EXIT_NOTICE_FD")
        assert sorted(ea) == sorted(eb), f
        assert {k: v for k, v in ea.items() if k not in RUN_SPECIFIC} == \
               {k: v for k, v in eb.items() if k not in RUN_SPECIFIC}, f
        # the notice page's fd: mmap keeps its own duplicate (leto_runtime's import does too);
        # no fence without a GPU
        assert sorted(k for k, v in a["fds"].items() if v != "/memfd") == ["0", "1", "2"], a
        assert list(a["fds"].values()).count("/memfd") == 1, (f, a["fds"])
        assert set(b["fds"]) == {"0", "1", "2", notice_fd}, (f, b["fds"])
        assert set(t["fds"]) == {"0", "1", "2"}, f
        assert a["parent"][1:3] == b["parent"][1:3] == ["-m", "leto_run"], f
        for k in ("own_group", "session_leader"):
            assert a[k] == b[k], (f, k)
    for run_ in (forked, plain, ref):     # a fresh interpreter seeds both generators anew
        assert run_["probe_0_0.json"]["random"] != run_["probe_1_0.json"]["random"]
        assert run_["probe_0_0.json"]["numpy"] != run_["probe_1_0.json"]["numpy"]
    evs = events(ev)
    assert [e["forked"] for e in of(evs, "spawn", role="active")] == [True, True]
    # the server is a fork of the agent (one import of torch for the job), and it imported
    # nothing more: the probe's code uses none of what the preload may add
    [server] = of(evs, "spawn", role="fork_server")
    assert server["how"] == "inherit" and server["preload"] == [], server
    assert "torch._dynamo" not in forked["probe_0_0.json"]["preloaded"]
    assert_nothing_left(evs)


def test_an_agent_started_with_interpreter_options_execs_its_fork_server(tmp_path):
    """``python -B -m leto_run``: a fork of that agent would hand -B to its workers, so the
    server is exec'd as ``python -u`` (it imports torch itself, and torch._dynamo: the script
    names torch.optim) and says why; the agent keeps its own command line (no
    re-execution)."""
    ev, out = tmp_path / "ev.jsonl", tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-B", *leto_cmd("--no-status", "--events", str(ev),
                                           "--nproc-per-node", "1",
                                           str(SCRIPTS / "probe_optim.py"))[1:]]
    r = run(cmd, base_env(out))
    assert r.returncode == 0, r.stderr[-3000:]
    evs = events(ev)
    [server] = of(evs, "spawn", role="fork_server")
    assert server["how"] == "exec" and "interpreter options (-B -m)" in server["exec_because"]
    assert server["preload"] == ["torch._dynamo"] and "torch.optim" in server["preload_because"]
    [probe] = [json.loads(p.read_text()) for p in out.glob("probe_*.json")]
    assert probe["torch_preloaded"] and probe["parent"][1:3] == ["-B", "-m"]
    assert "torch._dynamo" in probe["preloaded"], probe["preloaded"]
    flags = subprocess.run([sys.executable, "-u", "-c", "import sys; print(list(sys.flags))"],
                           capture_output=True, text=True, env=base_env(), timeout=60).stdout
    assert str(probe["flags"]) == flags.strip()          # a worker's, not the agent's -B
    assert_nothing_left(evs)


def test_a_marker_leto_run_did_not_set_never_makes_it_re_execute(tmp_path):
    """`LETO_AGENT_EXEC` in the environment without the re-execution's padding (set by hand,
    or left by something else): the agent is not taken for re-executed, never re-executes
    itself (no exec loop), execs its server and runs the job; no worker sees the marker."""
    ev, out = tmp_path / "ev.jsonl", tmp_path / "out"
    out.mkdir()
    r = run(leto_cmd("--no-status", "--events", str(ev), "--nproc-per-node", "1",
                     str(SCRIPTS / "procprobe.py")),
            base_env(out, LETO_AGENT_EXEC="t0k", LETO_JOB_TOKEN="t0k"), timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    evs = events(ev)
    [server] = of(evs, "spawn", role="fork_server")
    assert server["how"] == "exec" and "re-execute" in server["exec_because"], server
    [probe] = [json.loads(p.read_text()) for p in out.glob("probe_*.json")]
    assert probe["torch_preloaded"] and "LETO_AGENT_EXEC" not in probe["env"]
    assert probe["env"]["LETO_JOB_TOKEN"] != "t0k"          # the job's own token
    assert_nothing_left(evs)


def test_a_fork_server_killed_mid_job_leaves_the_next_workers_to_a_plain_spawn(tmp_path):
    out, ev = tmp_path / "out", tmp_path / "ev.jsonl"
    out.mkdir()
    # restart mode: no shadow is spawned after the last active, the one that kills the server
    r = run(leto_cmd("--no-status", "--events", str(ev), "--nproc-per-node", "2",
                     "--recovery", "restart", "--max-restarts", "1",
                     str(SCRIPTS / "procprobe.py")),
            base_env(out, PROBE_KILL_FORK_SERVER="1", PROBE_EXIT="1:1"))
    assert r.returncode == 0, r.stderr[-3000:]
    evs = events(ev)
    [down] = of(evs, "fork_server", state="down")
    assert "Signal 9" in down["reason"] or "Broken pipe" in down["reason"], down
    assert "fork server:" in r.stderr and "spawned plainly" in r.stderr
    spawns = of(evs, "spawn", role="active")
    assert [(e["restart_count"], e["forked"]) for e in spawns] == [(0, True), (0, True),
                                                                   (1, False), (1, False)]
    for rank in (0, 1):
        assert json.loads((out / f"probe_{rank}_0.json").read_text())["torch_preloaded"]
        assert not json.loads((out / f"probe_{rank}_1.json").read_text())["torch_preloaded"]
    assert_nothing_left(evs)


@pytest.mark.parametrize("fork", [True, False])
def test_a_plain_script_s_abrupt_death_is_seen_as_its_exit_begins(tmp_path, fork):
    """A script that never imports leto_runtime: forked, its exit notice is armed all the same,
    so the agent learns of a SIGKILL from the notice (`exit_started`) before the reap; spawned
    plainly (LETO_FORK_SERVER=0), only the reap tells."""
    out, ev = tmp_path / "out", tmp_path / "ev.jsonl"
    out.mkdir()
    r = run(leto_cmd("--no-status", "--events", str(ev), "--nproc-per-node", "2", "--recovery",
                     "restart", "--inject", "signal=SIGKILL:rank=1:after=2s",
                     str(SCRIPTS / "procprobe.py")),
            base_env(out, PROBE_SLEEP="60", LETO_FORK_SERVER="1" if fork else "0"))
    assert r.returncode == 1, r.stderr[-3000:]
    evs = events(ev)
    [victim] = of(evs, "spawn", role="active", rank=1)
    [det] = of(evs, "failure_detected", rank=1)
    started = of(evs, "exit_started", pid=victim["pid"])
    if fork:
        assert [e["exitcode"] for e in started] == [-9] and det["mono"] >= started[0]["mono"]
    else:
        assert not started
    assert "Signal 9 (SIGKILL)" in r.stderr
    assert_nothing_left(evs)


def test_a_forked_worker_gets_the_limits_the_agent_has_when_it_starts(tmp_path):
    """The agent raises its soft RLIMIT_NOFILE to the hard limit after its fork server started
    (in-place mode: the fd keepers).  A worker spawned by exec inherits the raised limit; a
    forked one must get it too, not the server's (`client.process_attrs`)."""
    import resource
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard <= 1024:
        pytest.skip(f"the hard RLIMIT_NOFILE ({hard}) leaves no room to start lower")

    def lower():
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    got = {}
    for knob in ("1", "0"):
        out = tmp_path / knob
        out.mkdir()
        r = run(leto_cmd("--no-status", "--nproc-per-node", "2", str(SCRIPTS / "procprobe.py")),
                base_env(out, LETO_FORK_SERVER=knob), preexec_fn=lower)
        assert r.returncode == 0, r.stderr[-3000:]
        got[knob] = [json.loads((out / f"probe_{rank}_0.json").read_text())["rlimits"]
                     ["RLIMIT_NOFILE"] for rank in (0, 1)]
        assert json.loads((out / "probe_0_0.json").read_text())["torch_preloaded"] == (knob == "1")
    assert got["1"] == got["0"] == [[hard, hard]] * 2, got


ATTRS = r'''import os, resource
umask = [l.split()[1] for l in open("/proc/self/status") if l.startswith("Umask:")][0]
print(umask, os.getpriority(os.PRIO_PROCESS, 0), sorted(os.sched_getaffinity(0)),
      resource.getrlimit(resource.RLIMIT_NOFILE))
'''


def test_a_forked_worker_takes_the_agent_s_process_attributes_at_its_request(tmp_path):
    """The agent's umask, nice value, CPU affinity and limits change after its fork server
    started (a `renice`, a `taskset`, its own RLIMIT_NOFILE raise): a worker forked after that
    has what a worker exec'd by the agent then has."""
    p = subprocess.run([sys.executable, str(SCRIPTS / "forkserver_driver.py"),
                        json.dumps([["-c", ATTRS]])], cwd=tmp_path,
                       env=base_env(DRIVER_CHANGE="1"), capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    [got] = json.loads(p.stdout)
    assert got["rc"] == got["exec"]["rc"] == 0, got
    assert got["stdout"] == got["exec"]["stdout"], got
    assert got["stdout"].split()[0] == "0027", got          # the change reached both
