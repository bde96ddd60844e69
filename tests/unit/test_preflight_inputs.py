"""Inputs preflight refuses before anything starts (leto_run.preflight, preflight_host,
ckpt_lock, config): planted or odd checkpoint lock files, a $TMPDIR too long for the run
directory's sockets, rank checks once `--nproc-per-node auto` is resolved, a script directory
without __main__, an unusable kernel cache, and rendezvous ids that would leave --log-dir.
Real files and directories throughout; the expectations are computed here, not read from the
code under test."""
from __future__ import annotations

import os
import tempfile
import zipfile

import pytest

from leto_run.ckpt_lock import LOCK_NAME, DirLock
from leto_run.cli import load_config
from leto_run.errors import ConfigError
from leto_run.preflight import preflight

ROOT_USER = os.geteuid() == 0
OTHER_UID = 65534                     # nobody: "another user on the machine"


@pytest.fixture
def job_dir(tmp_path, monkeypatch):
    """A directory holding train.py, as the cwd; TMPDIR a short private directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    tmp = tmp_path / "t"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp_path


def _pre(*args: str, env: dict | None = None) -> None:
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
    preflight(load_config(list(args), base), {**base, **(env or {})})


def _refused(*args: str, env: dict | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        _pre(*args, env=env)
    return e.value


# ---- the checkpoint lock (defects 3, 4) ------------------------------------------------------
def _ckpt(d) -> tuple[str, ...]:
    return ("--checkpoint-dir", str(d), "--checkpoint-every", "100", "train.py")


def test_a_symlink_at_the_lock_path_is_refused_and_its_target_untouched(job_dir):
    shared = job_dir / "shared"
    shared.mkdir(mode=0o777)
    victim = job_dir / "victim.txt"
    victim.write_text("precious\n")
    link = shared / LOCK_NAME
    link.symlink_to(victim)
    if ROOT_USER:
        os.lchown(link, OTHER_UID, OTHER_UID)      # planted by another user
    e = _refused(*_ckpt(shared))
    assert e.key == "checkpoint.dir" and "symbolic link" in e.problem and str(link) in e.problem
    with pytest.raises(ConfigError) as e2:          # the agent's own lock refuses it too
        DirLock(str(shared))
    assert "symbolic link" in e2.value.problem
    assert victim.read_text() == "precious\n" and link.is_symlink()


@pytest.mark.parametrize("kind", ["directory", "fifo", "hard link"])
def test_a_lock_path_that_is_no_lock_file_of_ours_is_refused(job_dir, kind):
    d = job_dir / "ck"
    d.mkdir()
    path = d / LOCK_NAME
    other = job_dir / "other.txt"
    other.write_text("someone's file\n")
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        os.link(other, path)
    e = _refused(*_ckpt(d))
    assert e.key == "checkpoint.dir" and str(path) in e.problem
    with pytest.raises(ConfigError):
        DirLock(str(d))
    assert other.read_text() == "someone's file\n"


@pytest.mark.skipif(not ROOT_USER, reason="needs root to make a file another user owns")
def test_a_lock_file_of_another_user_is_refused(job_dir):
    d = job_dir / "ck"
    d.mkdir()
    (d / LOCK_NAME).write_text("pid 1")
    os.chown(d / LOCK_NAME, OTHER_UID, OTHER_UID)
    e = _refused(*_ckpt(d))
    assert f"uid {OTHER_UID}" in e.problem
    assert (d / LOCK_NAME).read_text() == "pid 1"


def test_release_leaves_a_file_that_replaced_ours(job_dir):
    d = job_dir / "ck"
    lock = DirLock(str(d))
    os.unlink(d / LOCK_NAME)                   # another user, in a shared directory
    (d / LOCK_NAME).write_text("theirs")
    lock.release()
    assert (d / LOCK_NAME).read_text() == "theirs"


def test_our_own_stale_lock_file_is_reused(job_dir):
    d = job_dir / "ck"
    d.mkdir()
    (d / LOCK_NAME).write_text("pid 999999")   # a job of ours that was killed
    _pre(*_ckpt(d))
    DirLock(str(d)).release()
    assert not (d / LOCK_NAME).exists()


# ---- $TMPDIR and the AF_UNIX sockets (defect 5) ------------------------------------------------
def _tmpdir_of(job_dir, length: int) -> str:
    base = str(job_dir / "t")
    path = base + "/" + "d" * (length - len(base) - 1)
    os.makedirs(path)
    return path


@pytest.mark.parametrize("mode,longest", [("inplace", "sm0.keeper.sock"), ("restart", "hb.sock")])
def test_tmpdir_must_leave_room_for_the_longest_socket(job_dir, monkeypatch, mode, longest):
    # <TMPDIR>/leto-XXXXXXXX/<socket>: sun_path holds 107 bytes and a NUL
    fits = 107 - len("/leto-XXXXXXXX/") - len(longest)
    monkeypatch.setattr(tempfile, "tempdir", _tmpdir_of(job_dir, fits))
    _pre("--recovery", mode, "train.py")
    too_long = _tmpdir_of(job_dir, fits + 1)
    monkeypatch.setattr(tempfile, "tempdir", too_long)
    e = _refused("--recovery", mode, "train.py")
    assert e.key == "TMPDIR" and f"({fits + 1} bytes)" in e.problem and "107" in e.problem
    assert "shorter directory" in e.fix and longest in e.problem


def test_more_slots_need_a_shorter_tmpdir(job_dir, monkeypatch):
    fits_one = 107 - len("/leto-XXXXXXXX/sm0.keeper.sock")
    monkeypatch.setattr(tempfile, "tempdir", _tmpdir_of(job_dir, fits_one))
    assert "sm10.keeper.sock" in _refused("--nproc-per-node", "11", "train.py").problem


# ---- ranks once --nproc-per-node auto is resolved (defect 9) -----------------------------------
def test_auto_nproc_gets_the_rank_checks_of_a_given_count(job_dir):
    n = os.cpu_count()                      # auto on a CPU-only machine: one per core
    e = _refused("--nproc-per-node", "auto", "--local-ranks-filter", str(n), "train.py")
    assert e.key == "logs.local_ranks_filter" and f"resolved to {n}" in e.problem
    e = _refused("--nproc-per-node", "cpu", "--tee", f"0:3,{n}:3", "train.py")
    assert e.key == "logs.tee" and f"[{n}]" in e.problem
    e = _refused("--nproc-per-node", "auto", "--inject", f"kill:rank={n}:after=1s", "train.py")
    assert e.key == "inject[0]" and "world size" in e.problem
    _pre("--nproc-per-node", "auto", "--local-ranks-filter", str(n - 1),
         "--inject", f"kill:rank={n - 1}:after=1s", "train.py")


def test_auto_nproc_on_several_nodes_checks_local_ranks_only(job_dir):
    """Other nodes may resolve auto to other counts: the world size is unknown here."""
    n = os.cpu_count()
    multi = ("--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29999",
             "--nproc-per-node", "auto", "--recovery", "restart")    # in place: a secret too
    _pre(*multi, "--inject", f"kill:rank={n}:after=1s", "train.py")
    assert _refused(*multi, "--local-ranks-filter", str(n), "train.py").key == \
        "logs.local_ranks_filter"


# ---- the script: a directory or zip needs __main__ (defect 14) ---------------------------------
def test_a_script_directory_or_zip_needs_a_main_module(job_dir):
    (job_dir / "adir").mkdir()
    e = _refused("adir")
    assert e.key == "launch.training_script" and "__main__" in e.problem
    (job_dir / "adir" / "__main__.py").write_text("print('hi')\n")
    _pre("adir")
    with zipfile.ZipFile(job_dir / "app.zip", "w") as z:
        z.writestr("lib.py", "")
    assert "__main__" in _refused("app.zip").problem
    with zipfile.ZipFile(job_dir / "app2.zip", "w") as z:
        z.writestr("__main__.py", "print('hi')\n")
    _pre("app2.zip")
    _pre("-m", "adir")                      # a module: the interpreter finds it, not us


# ---- the kernel cache (defect 11) --------------------------------------------------------------
@pytest.mark.parametrize("var", ["LETO_EXT_DIR", "TORCH_EXTENSIONS_DIR", "XDG_CACHE_HOME"])
def test_a_kernel_cache_under_a_file_is_refused_naming_the_variable(job_dir, var):
    (job_dir / "afile").write_text("")
    e = _refused("train.py", env={var: str(job_dir / "afile" / "x")})
    assert e.key == var and str(job_dir / "afile") in e.problem and "LETO_EXT_DIR" in e.fix
    _pre("train.py", env={var: str(job_dir / "cache" / "x")})      # creatable: fine
    assert not (job_dir / "cache").exists()                        # and not created


def test_a_kernel_cache_others_can_write_is_refused_before_the_runtime_would(job_dir):
    """What the runtime refuses (UnsafeCache: another user could plant kernels that run as
    us) is refused at start, naming the variable, the path and the fix."""
    shared = job_dir / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)                          # world-writable, not sticky
    e = _refused("train.py", env={"LETO_EXT_DIR": str(shared / "kernels")})
    assert e.key == "LETO_EXT_DIR" and str(shared) in e.problem and "every user" in e.problem
    assert "chmod go-w" in e.fix
    os.chmod(shared, 0o755)
    _pre("train.py", env={"LETO_EXT_DIR": str(shared / "kernels")})


def test_only_leto_ext_dir_is_checked_in_restart_mode(job_dir):
    (job_dir / "afile").write_text("")
    bad = str(job_dir / "afile" / "x")
    _pre("--recovery", "restart", "train.py", env={"XDG_CACHE_HOME": bad})
    assert _refused("--recovery", "restart", "train.py",
                    env={"LETO_EXT_DIR": bad}).key == "LETO_EXT_DIR"


# ---- the rendezvous id names a directory under --log-dir --------------------------------------
@pytest.mark.parametrize("rid", ["../../escaped", "a/b", "x" * 247, "a\0b"],
                         ids=["dotdot", "slash", "247 bytes", "nul"])
def test_rendezvous_ids_that_are_not_one_file_name_are_refused(rid):
    with pytest.raises(ConfigError) as e:
        load_config(["--rdzv-id", rid, "train.py"], {})
    assert e.value.key == "rendezvous.id"


@pytest.mark.parametrize("rid", ["run..1", "x" * 246, "12345", "job-ä"],
                         ids=["dots inside", "246 bytes", "digits", "non-ascii"])
def test_rendezvous_ids_of_one_file_name_are_kept(rid):
    assert load_config(["--rdzv-id", rid, "train.py"], {}).rendezvous.id == rid
