"""Checkpoint layout, completeness and rotation (leto_runtime.wire.ckpt_files) over directories
that torch.distributed.checkpoint really wrote, the interval rule (`ckpt_writer.due`), the
fallback decision (`fallback.decide_fallback`), the `checkpoint` config section and its worker
environment, and the preflight of --checkpoint-dir."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from leto_run.config_checkpoint import worker_env
from leto_run.config_load import build_config
from leto_run.errors import ConfigError
from leto_run.fallback import decide_fallback
from leto_run.preflight import preflight
from leto_runtime.ckpt_writer import due
from leto_runtime.wire.ckpt_files import Settings
from leto_runtime.wire import ckpt_files as F
from leto_runtime.wire import contract as C


def _write(root, step: int, world: int = 2) -> str:
    """A checkpoint as the writer makes it: DCP files, then the manifest, then the rename."""
    tmp = os.path.join(root, F.partial_name(step, 1))
    os.makedirs(tmp)
    dcp.save({"w": torch.arange(8.0) + step, "step": step}, checkpoint_id=tmp, no_dist=True)
    with open(os.path.join(tmp, F.MANIFEST), "w") as f:
        json.dump(F.manifest(step, world, tmp), f)
    final = os.path.join(root, F.name(step))
    os.rename(tmp, final)
    return final


def test_a_complete_checkpoint_loads_with_stock_dcp(tmp_path):
    path = _write(tmp_path, 6)
    assert F.check(path).complete
    got = {"w": torch.zeros(8), "step": 0}
    dcp.load(got, checkpoint_id=path, no_dist=True)
    assert torch.equal(got["w"], torch.arange(8.0) + 6) and got["step"] == 6


@pytest.mark.parametrize("damage, reason", [
    ("no manifest", "no leto_checkpoint.json"),
    ("a data file missing", "is missing"),
    ("a data file truncated", "the manifest says"),
    ("no metadata", "is missing"),
    ("another step's manifest", "does not describe"),
    ("garbage manifest", "unreadable"),
])
def test_every_kind_of_torn_checkpoint_is_never_the_newest(tmp_path, damage, reason):
    _write(tmp_path, 3)
    path = _write(tmp_path, 6)
    data = next(f for f in os.listdir(path) if f.endswith(".distcp"))
    if damage == "no manifest":
        os.remove(os.path.join(path, F.MANIFEST))
    elif damage == "a data file missing":
        os.remove(os.path.join(path, data))
    elif damage == "a data file truncated":
        with open(os.path.join(path, data), "r+b") as f:
            f.truncate(3)
    elif damage == "no metadata":
        os.remove(os.path.join(path, ".metadata"))
    elif damage == "another step's manifest":
        man = json.load(open(os.path.join(path, F.MANIFEST)))
        man["step"] = 9
        json.dump(man, open(os.path.join(path, F.MANIFEST), "w"))
    else:
        open(os.path.join(path, F.MANIFEST), "w").write("{not json")
    found = F.check(path)
    assert not found.complete and reason in found.reason
    assert F.newest(str(tmp_path)).step == 3


def _dead_pid() -> int:
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _age(path, seconds: float) -> None:
    import time
    for root, dirs, files in os.walk(path):
        for e in [root] + [os.path.join(root, f) for f in files]:
            os.utime(e, (time.time() - seconds, time.time() - seconds))


def test_partials_are_torn_and_rotation_keeps_the_newest_complete(tmp_path):
    for s in (3, 6, 9):
        _write(tmp_path, s)
    dead = _dead_pid()
    os.makedirs(tmp_path / F.partial_name(4, dead))
    _age(tmp_path / F.partial_name(4, dead), 2 * F.PARTIAL_IDLE_S)   # its writer is gone
    os.makedirs(tmp_path / F.partial_name(12, 78))           # being written now
    (tmp_path / "notes.txt").write_text("the user's")
    removed = F.rotate(str(tmp_path), keep=2, busy=str(tmp_path / F.partial_name(12, 78)))
    assert sorted(os.path.basename(f.path) for f in removed) == [F.partial_name(4, dead),
                                                                 F.name(3)]
    assert sorted(os.listdir(tmp_path)) == sorted([F.partial_name(12, 78), F.name(6), F.name(9),
                                                   "notes.txt"])
    assert F.newest(str(tmp_path)).step == 9
    assert F.newest(str(tmp_path / "missing")) is None


def test_rotation_never_removes_a_partial_its_writer_may_still_rename(tmp_path):
    """A partial older than the newest complete checkpoint is another writer's (a promoted
    shadow's write in flight, the agent of another node of a shared directory): removed while
    its writer renames it, it would tear the checkpoint it becomes.  Kept while its writer's
    pid lives here; one written elsewhere (another pid namespace) while anything in it changed
    within PARTIAL_IDLE_S; one of a dead writer of this pid namespace goes at once."""
    _write(tmp_path, 9)
    dead = _dead_pid()
    live = tmp_path / F.partial_name(5, os.getpid(), "ab12")        # a live writer
    recent = tmp_path / F.partial_name(6, dead, "cd34")             # another host's, active
    (recent / "sub").mkdir(parents=True)
    live.mkdir()
    (recent / "__0_0.distcp").write_bytes(b"x")
    _age(recent, 2 * F.PARTIAL_IDLE_S)
    os.utime(recent / "__0_0.distcp")                               # ... written to just now
    idle = tmp_path / F.partial_name(7, dead, "ef56")               # nobody's, long idle
    idle.mkdir()
    _age(idle, 2 * F.PARTIAL_IDLE_S)
    here = tmp_path / F.partial_name(8, dead, F.pid_space() + "0a0b")   # a dead writer here
    (here / "__0_0.distcp").parent.mkdir()
    (here / "__0_0.distcp").write_bytes(b"x")                       # (just now)
    removed = F.rotate(str(tmp_path), keep=2)
    assert [os.path.basename(f.path) for f in removed] == [idle.name, here.name]
    assert live.is_dir() and recent.is_dir() and F.newest(str(tmp_path)).step == 9


def test_the_interval_rule():
    steps, secs = Settings("d", every_steps=3), Settings("d", every_s=10.0)
    young = Settings("d", ff_mtbf=3600.0)
    kw = dict(last_step=None, since_last=0.0, cost=None)
    assert [t for t in range(8) if due(t, 0, steps, **kw)[0]] == [3, 6]
    assert not due(3, 3, steps, **kw)[0]                   # the step it started from
    assert not due(6, 0, steps, last_step=6, since_last=0, cost=None)[0]
    assert due(5, 0, secs, last_step=None, since_last=10.0, cost=None)[0]
    assert not due(5, 0, secs, last_step=None, since_last=9.9, cost=None)[0]
    assert due(1, 0, young, **kw)[0]                       # the first measures the cost
    # Young: sqrt(2 * C * M) = sqrt(2 * 0.5 * 3600) = 60 s
    yes, why = due(9, 0, young, last_step=1, since_last=60.0, cost=0.5)
    assert yes and "60" in why
    assert not due(9, 0, young, last_step=1, since_last=59.0, cost=0.5)[0]


def test_the_fallback_decision():
    found = F.Found("/c/step_000000006", 6, True, "")
    torn = [F.Found("/c/.partial-step_000000009-1", 9, False, "a partial write")]
    assert decide_fallback("off", None, None, [], 0, 3) == (
        False, "checkpointing is off (no --checkpoint-dir), so there is nothing to fall back to")
    ok, why = decide_fallback("steps", "/c", None, torn, 0, 3)
    assert not ok and "no complete checkpoint in /c" in why and "1 torn" in why
    ok, why = decide_fallback("steps", "/c", found, torn, 3, 3)
    assert not ok and "all 3 checkpoint fallbacks used" in why
    ok, why = decide_fallback("steps", "/c", found, torn, 1, 3)
    assert ok and "step 6" in why and "fallback 2 of 3" in why and "partial-step_000000009" in why
    ok, why = decide_fallback("steps", "/c", found, torn, 0, 3, static_nodes=True)
    assert not ok and "static rendezvous" in why and "c10d" in why


def _cfg(*args: str, env=None):
    cli = {}
    given = set()
    it = iter(args)
    for flag in it:
        dest = flag[2:].replace("-", "_")
        cli[dest] = next(it)
        given.add(dest)
    cli["training_script"] = "train.py"
    given.add("training_script")
    return build_config(cli, given, env or {}, None, new_id=lambda: "RID")


@pytest.mark.parametrize("args, key, problem", [
    (("--checkpoint-dir", "/c", "--checkpoint-every", "0"), "checkpoint.every", "at least one step"),
    (("--checkpoint-every", "10"), "checkpoint.every", "checkpoint.dir is not"),
    (("--checkpoint-dir", "/c"), "checkpoint.every", "is not set"),
    (("--checkpoint-dir", "/c", "--checkpoint-every", "auto"), "checkpoint.every", "--ff-mtbf"),
    (("--checkpoint-dir", "/c", "--checkpoint-every", "10", "--ff-mtbf", "6h"),
     "checkpoint.ff_mtbf", "contradicts"),
    (("--checkpoint-dir", "/c", "--checkpoint-every", "soon"), "checkpoint.every", "neither"),
    (("--checkpoint-dir", "/c", "--ff-mtbf", "-1h"), "checkpoint.ff_mtbf", "not a duration"),
    (("--checkpoint-dir", "/c", "--checkpoint-every", "5", "--checkpoint-keep", "0"),
     "checkpoint.keep", "1.."),
    (("--checkpoint-dir", "/c", "--checkpoint-every", "99999999999999999999999"),
     "checkpoint.every", ""),
])
def test_bad_checkpoint_settings_are_config_errors(args, key, problem):
    with pytest.raises(ConfigError) as e:
        _cfg(*args)
    assert e.value.key == key and problem in e.value.problem, e.value


def test_checkpoint_settings_reach_the_trainers_and_the_agent_s_own_do_not():
    c = _cfg("--checkpoint-dir", "/c", "--ff-mtbf", "2h").checkpoint
    assert (c.mode, c.every_steps, c.every_s, c.ff_mtbf_s) == ("auto", 0, 0.0, 7200.0)
    assert _cfg("--checkpoint-dir", "/c", "--checkpoint-every", "90s").checkpoint.every_s == 90
    env = dict(worker_env(c, "/c/step_000000006"))
    assert env == {C.LETO_CHECKPOINT_DIR: "/c", C.LETO_CHECKPOINT_EVERY_STEPS: "0",
                   C.LETO_CHECKPOINT_EVERY_S: "0.0", C.LETO_CHECKPOINT_FF_MTBF_S: "7200.0",
                   C.LETO_CHECKPOINT_KEEP: "2", C.LETO_CHECKPOINT_WRITER: "auto",
                   C.LETO_CHECKPOINT_LOAD: "/c/step_000000006"}
    t = _cfg("--checkpoint-dir", "/c", "--checkpoint-every", "5", "--checkpoint-writer",
             "trainer").checkpoint
    assert dict(worker_env(t, None))[C.LETO_CHECKPOINT_WRITER] == "trainer"
    with pytest.raises(ConfigError) as e:
        _cfg("--checkpoint-dir", "/c", "--checkpoint-every", "5", "--checkpoint-writer", "active")
    assert e.value.key == "checkpoint.writer" and "'active'" in e.value.problem


def test_preflight_refuses_a_directory_of_an_earlier_run_and_one_under_a_file(tmp_path,
                                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")        # the script preflight looks for
    _write(tmp_path / "old", 6)
    with pytest.raises(ConfigError) as e:
        preflight(_cfg("--checkpoint-dir", str(tmp_path / "old"), "--checkpoint-every", "5"), {
            "PATH": os.environ["PATH"]})
    assert e.value.key == "checkpoint.dir" and "earlier run" in e.value.problem
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError) as e:
        preflight(_cfg("--checkpoint-dir", str(tmp_path / "f" / "c"), "--checkpoint-every",
                       "5"), {"PATH": os.environ["PATH"]})
    assert e.value.key == "checkpoint.dir" and "is a file" in e.value.problem
    preflight(_cfg("--checkpoint-dir", str(tmp_path / "new" / "c"), "--checkpoint-every", "5"),
              {"PATH": os.environ["PATH"]})
    assert not (tmp_path / "new").exists()            # preflight creates nothing


def test_one_job_per_checkpoint_directory(tmp_path):
    from leto_run.ckpt_lock import LOCK_NAME, DirLock
    first = DirLock(str(tmp_path / "ck"))
    with pytest.raises(ConfigError) as e:
        DirLock(str(tmp_path / "ck"))
    assert e.value.key == "checkpoint.dir" and f"pid {os.getpid()}" in e.value.problem
    assert F.scan(str(tmp_path / "ck")) == []           # the lock is no checkpoint
    first.release()
    assert not (tmp_path / "ck" / LOCK_NAME).exists()
    DirLock(str(tmp_path / "ck")).release()             # free again


def test_the_agents_of_one_multi_node_job_share_the_directory_and_no_other_job_does(tmp_path):
    from leto_run.ckpt_lock import LOCK_NAME, DirLock
    d = str(tmp_path / "ck")
    node0, node1 = DirLock(d, job="h:29400/run-a"), DirLock(d, job="h:29400/run-a")
    with pytest.raises(ConfigError) as e:
        DirLock(d, job="h:29400/run-b")               # another multi-node job
    assert "job h:29400/run-a" in e.value.problem and "--checkpoint-dir" in e.value.fix
    with pytest.raises(ConfigError):
        DirLock(d)                                     # a single-node job
    node0.release()
    assert (tmp_path / "ck" / LOCK_NAME).exists()      # node 1 still holds it
    node1.release()
    assert not (tmp_path / "ck" / LOCK_NAME).exists()  # the last holder removed it
    single = DirLock(d)
    with pytest.raises(ConfigError) as e:
        DirLock(d, job="h:29400/run-a")                # held exclusively: refused in time
    assert f"pid {os.getpid()}" in e.value.problem
    single.release()


def test_a_fallback_waits_only_for_a_newer_checkpoint_its_own_live_process_writes(tmp_path):
    import subprocess
    import sys
    from leto_run.fallback import _alive, in_flight
    _write(tmp_path, 3)
    (tmp_path / F.partial_name(6, 4242)).mkdir()        # the shadow of this job writes step 6
    (tmp_path / F.partial_name(2, 4343)).mkdir()        # older than the newest complete one
    scan = F.scan(str(tmp_path))
    assert in_flight(scan, {4242, 4343}).step == 6
    assert in_flight(scan, {4343}) is None               # its writer is not ours, or is gone
    assert in_flight(scan, set()) is None
    _write(tmp_path, 9)
    assert in_flight(F.scan(str(tmp_path)), {4242}) is None   # a newer complete one exists
    assert F.partial_pid(str(tmp_path / F.partial_name(6, 4242))) == 4242
    assert F.partial_pid(str(tmp_path / "step_000000003")) is None
    z = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, z.pid, os.WEXITED | os.WNOWAIT)   # exited, not reaped: a zombie
    assert _alive(os.getpid()) and not _alive(z.pid)
    z.wait()
    assert not _alive(z.pid)


def test_a_node_refuses_to_follow_a_checkpoint_it_does_not_see_complete(tmp_path):
    """The round agreed on a checkpoint this node's view of the directory does not hold
    complete: the node stops and says why instead of starting trainers that cannot load it."""
    import types
    from leto_run.config_checkpoint import CheckpointConfig
    from leto_run.fallback import FallbackPolicy
    events, logs = [], []
    group = types.SimpleNamespace(generation=2, log=logs.append, checkpoint_load=None,
                                  events=types.SimpleNamespace(emit=lambda *a, **k: events.append(
                                      (a, k))))
    policy = FallbackPolicy(group, CheckpointConfig(dir=str(tmp_path), every="3"), sms=None)
    good = _write(tmp_path, 6)
    torn = _write(tmp_path, 9)
    os.remove(os.path.join(torn, F.MANIFEST))
    why = policy.follow(torn, "node 1 fell back", inplace=True)
    assert why is not None and "not complete on this node" in why and F.MANIFEST in why
    assert group.checkpoint_load is None and policy.used == 0 and events == []
    assert policy.follow(good, "node 1 fell back", inplace=True) is None
    assert group.checkpoint_load == good and policy.used == 1
    assert events[0][1]["step"] == 6 and events[0][1]["by"] == "peer"
