"""`leto-run` refuses bad inputs with exit 2 and one typed line before anything starts: no
guardian, run directory, log directory, store, checkpoint lock or worker (the private TMPDIR
and the checkpoint directory are left as they were).  Each case is a red-team report: the
real command line, a real process, real files."""
from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

from leto_run.ckpt_lock import LOCK_NAME
from leto_testing import base_env, leto_cmd

ROOT_USER = os.geteuid() == 0


@pytest.fixture
def job(tmp_path):
    (tmp_path / "hello.py").write_text("import os\nprint('hello', os.environ['RANK'])\n")
    (tmp_path / "t").mkdir()
    return tmp_path


def _leto(job, *args, env=None, nofile=None):
    def limit():                           # in the child only: the test process keeps its own
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    e = base_env(**{"TMPDIR": str(job / "t"), **(env or {})})
    return subprocess.run(leto_cmd(*args), env=e, cwd=job, capture_output=True, text=True,
                          timeout=60, preexec_fn=limit if nofile else None)


def _refused(p, key: str) -> None:
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.startswith(f"leto-run: error: {key}"), p.stderr
    assert "Traceback" not in p.stderr and "hello" not in p.stdout


def _nothing_started(job) -> None:
    assert os.listdir(job / "t") == []      # no run dir, no default log dir


def test_planted_symlink_lock_is_exit_2_and_the_victim_is_untouched(job):
    shared = job / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    victim = job / "victim.txt"
    victim.write_text("victim\n")
    (shared / LOCK_NAME).symlink_to(victim)
    if ROOT_USER:
        os.lchown(shared / LOCK_NAME, 65534, 65534)
    p = _leto(job, "--checkpoint-dir", "shared", "--checkpoint-every", "100", "hello.py")
    _refused(p, "checkpoint.dir")
    assert "symbolic link" in p.stderr
    assert victim.read_text() == "victim\n" and (shared / LOCK_NAME).is_symlink()
    _nothing_started(job)


def test_a_directory_at_the_lock_path_is_exit_2(job):
    (job / "shared2" / LOCK_NAME).mkdir(parents=True)
    p = _leto(job, "--checkpoint-dir", "shared2", "--checkpoint-every", "100", "hello.py")
    _refused(p, "checkpoint.dir")
    assert "not a regular file" in p.stderr
    _nothing_started(job)


@pytest.mark.parametrize("mode,length", [("inplace", 82), ("restart", 96)])
def test_a_tmpdir_too_long_for_the_sockets_is_exit_2(job, mode, length):
    long_tmp = str(job / "t") + "/" + "x" * (length - len(str(job / "t")) - 1)
    os.makedirs(long_tmp)
    p = _leto(job, "--recovery", mode, "hello.py", env={"TMPDIR": long_tmp})
    _refused(p, "TMPDIR")
    assert f"({length} bytes)" in p.stderr and "107" in p.stderr
    assert os.listdir(long_tmp) == []


def test_auto_nproc_gets_the_rank_checks(job):
    n = os.cpu_count()
    p = _leto(job, "--nproc-per-node", "auto", "--local-ranks-filter", str(n + 5), "--tee",
              f"0:3,{n + 7}:3", "hello.py")
    _refused(p, "logs.tee")
    p = _leto(job, "--nproc-per-node", "auto", "--inject", f"kill:rank={n + 3}:after=1s",
              "hello.py")
    _refused(p, "inject[0]")
    _nothing_started(job)


def test_a_kernel_cache_that_cannot_exist_is_exit_2(job):
    p = _leto(job, "hello.py", env={"LETO_EXT_DIR": "/dev/null/x"})
    _refused(p, "LETO_EXT_DIR")
    assert "'/dev/null' is not a directory" in p.stderr
    _nothing_started(job)


def test_a_script_directory_without_main_is_exit_2(job):
    (job / "adir").mkdir()
    p = _leto(job, "--max-restarts", "2", "adir")
    _refused(p, "launch.training_script")
    _nothing_started(job)


def test_a_low_fd_limit_is_exit_2(job):
    p = _leto(job, "hello.py", nofile=64)
    _refused(p, "RLIMIT_NOFILE")
    assert "is 64" in p.stderr
    _nothing_started(job)


@pytest.mark.parametrize("rid", ["../../escaped", "a/b", "r" * 300],
                         ids=["dotdot", "slash", "300 bytes"])
def test_a_rendezvous_id_that_would_leave_the_log_dir_is_exit_2(job, rid):
    p = _leto(job, "--rdzv-id", rid, "--log-dir", "logs/x", "hello.py")
    _refused(p, "rendezvous.id")
    assert sorted(os.listdir(job)) == ["hello.py", "t"]
    _nothing_started(job)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
