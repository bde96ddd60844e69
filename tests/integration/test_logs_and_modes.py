"""torchrun's log layout, redirects/tee/filter semantics and the -m / --no-python / --run-path
entry modes, checked side by side with torchrun where torchrun defines the behaviour."""
import os

import pytest

from leto_testing import SCRIPTS, base_env, leto_cmd, run, torchrun_cmd


def tree(root):
    """Relative files of torchrun's layout below <log_dir>/<run_id>_*/attempt_*/ (the per-run
    folder name is random).  Leto adds files next to the attempt folders (events.jsonl,
    state_manager_<local_rank>.log), a documented addition outside torchrun's layout."""
    (run_dir,) = [d for d in root.iterdir() if d.is_dir()]
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.glob("attempt_*/**/*.log"))


@pytest.mark.parametrize("flags", [["-t", "3"], ["-r", "1"], ["-r", "0:3,1:2"]])
def test_log_layout_matches_torchrun(tmp_path, out_dir, flags):
    layouts = {}
    for name, cmd in (("torchrun", torchrun_cmd), ("leto", leto_cmd)):
        logs = tmp_path / f"logs_{name}"
        r = run(cmd("--nproc-per-node", "2", "--log-dir", str(logs), *flags,
                    str(SCRIPTS / "hello.py")), base_env(out_dir))
        assert r.returncode == 0, r.stderr[-2000:]
        layouts[name] = (tree(logs), "hello-out rank 0" in r.stdout, "hello-err rank 1" in r.stderr)
    assert layouts["leto"][0] == layouts["torchrun"][0]
    # Console visibility follows the same rule (redirected streams leave the console).
    assert layouts["leto"][1:] == layouts["torchrun"][1:]


def test_log_files_hold_worker_output(tmp_path, out_dir):
    logs = tmp_path / "logs"
    r = run(leto_cmd("--no-status", "--nproc-per-node", "2", "--log-dir", str(logs), "-t", "3",
                     str(SCRIPTS / "hello.py")), base_env(out_dir))
    assert r.returncode == 0
    (run_dir,) = list(logs.iterdir())
    assert (run_dir / "attempt_0/1/stdout.log").read_text() == "hello-out rank 1\n"
    assert (run_dir / "attempt_0/0/stderr.log").read_text() == "hello-err rank 0\n"
    assert "[r1 active g0]: hello-out rank 1" in r.stdout        # console lines say who


def test_local_ranks_filter(out_dir):
    r = run(leto_cmd("--no-status", "--nproc-per-node", "3", "--local-ranks-filter", "0,2",
                     str(SCRIPTS / "hello.py")), base_env(out_dir))
    assert r.returncode == 0
    assert "hello-out rank 0" in r.stdout and "hello-out rank 2" in r.stdout
    assert "hello-out rank 1" not in r.stdout
    assert (out_dir / "hello_1").exists()       # filtered from the console, still ran


def test_module_mode(out_dir):
    env = base_env(out_dir, PYTHONPATH=str(SCRIPTS))
    r = run(leto_cmd("--no-status", "--nproc-per-node", "2", "-m", "hello", "a", "--b"), env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out_dir / "hello_1").read_text() == "a --b"


def test_no_python_mode(out_dir):
    r = run(leto_cmd("--no-status", "--nproc-per-node", "2", "--no-python", "/bin/sh", "-c",
                     'echo "$RANK/$WORLD_SIZE" > "$OUT_DIR/sh_$RANK"'), base_env(out_dir))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out_dir / "sh_1").read_text().strip() == "1/2"


def test_run_path_mode(out_dir):
    r = run(leto_cmd("--no-status", "--run-path", str(SCRIPTS / "hello.py"), "x"), base_env(out_dir))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out_dir / "hello_0").read_text() == "x"


def test_script_args_that_look_like_options(out_dir):
    r = run(leto_cmd("--no-status", str(SCRIPTS / "hello.py"), "--nproc-per-node", "7", "-m"),
            base_env(out_dir))
    assert r.returncode == 0 and (out_dir / "hello_0").read_text() == "--nproc-per-node 7 -m"
    assert not (out_dir / "hello_1").exists()


def test_status_views(out_dir):
    """--status draws the live table (ranks, roles, state, step); --no-status prints plain
    state-change lines instead."""
    r = run(leto_cmd("--status", "--nproc-per-node", "2", str(SCRIPTS / "fail_until.py"), "0"),
            base_env(out_dir))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "generation 0" in r.stderr and "last heartbeat" in r.stderr
    assert "[leto-run status" not in r.stderr
    r = run(leto_cmd("--no-status", "--nproc-per-node", "2", str(SCRIPTS / "fail_until.py"), "0"),
            base_env(out_dir))
    assert "rank 1 active" in r.stderr and "succeeded" in r.stderr
