"""The kernel cache builds and loads only where no other user can write
(leto_runtime/wire/kernel_cache.py: `_private_dirs`, `_complete`, `BuildLock._open`): a planted
lock symlink or FIFO, another user's slot or library, a world-writable root and a symlinked
root are refused with `UnsafeCache` (path and fix) or rebuilt over, never followed or loaded.
Real builds (the system C++ compiler) and real loads (ctypes)."""
from __future__ import annotations

import ctypes
import grp
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from leto_runtime.wire import kernel_cache as K

OTHER = 65534                       # nobody / nogroup
SRC = 'extern "C" int leto_tiny(void) { return %d; }\n'

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root"),
              pytest.mark.skipif(K.cxx() is None, reason="no C++ compiler")]


@pytest.fixture
def env(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "tiny.cpp").write_text(SRC % 42)
    monkeypatch.setattr(K, "source_dir", lambda: src)
    monkeypatch.setenv("LETO_EXT_DIR", str(tmp_path / "cache"))
    return tmp_path


def _spec() -> K.Spec:
    return K.Spec(name="leto_tiny", what="a test kernel", sources=("tiny.cpp",),
                  compilers=(K.cxx(),), flags=("-shared", "-fPIC", "-O0"))


def _obtain() -> K.Obtained:
    return K.obtain(_spec(), lambda slot: K.compile_library(
        slot, K.cxx(), ["-shared", "-fPIC", "-O0"], [], "libleto_tiny.so"))


def _call(path: Path) -> int:
    return ctypes.CDLL(str(path)).leto_tiny()


def _chown_tree(path: Path, uid: int) -> None:
    for top, dirs, files in os.walk(path):
        os.chown(top, uid, uid)
        for f in files:
            os.lchown(os.path.join(top, f), uid, uid)


def test_a_build_is_private_even_under_umask_0(env):
    old = os.umask(0)
    try:
        got = _obtain()
    finally:
        os.umask(old)
    assert got.built and _call(got.path) == 42
    slot = got.path.parent
    for p in [slot, slot / "src", K.root()]:
        assert stat.S_IMODE(os.stat(p).st_mode) & 0o022 == 0, p
    for p in [got.path, slot / K.MANIFEST, slot / "src" / "tiny.cpp"]:
        assert stat.S_IMODE(os.stat(p).st_mode) & 0o022 == 0, p
    again = _obtain()
    assert not again.built and again.path == got.path


def test_a_planted_lock_symlink_is_refused_and_its_target_untouched(env):
    slot = K.slot_for(_spec()).dir
    slot.mkdir(parents=True)
    victim = env / "victim.txt"
    victim.write_text("precious")
    os.symlink(victim, slot / ".leto-build.flock")
    with pytest.raises(K.UnsafeCache) as e:
        _obtain()
    assert ".leto-build.flock" in str(e.value) and "symbolic link" in str(e.value)
    assert "LETO_EXT_DIR" in str(e.value)
    assert victim.read_text() == "precious"


def test_a_planted_lock_fifo_is_refused_without_hanging(env):
    slot = K.slot_for(_spec()).dir
    slot.mkdir(parents=True)
    os.mkfifo(slot / ".leto-build.flock")
    # A child process: a regression would hang in open(), the timeout ends it.
    code = ("import sys; sys.path[:0] = %r\n"
            "from leto_runtime.wire import kernel_cache as K\n"
            "from pathlib import Path\n"
            "try:\n"
            "    with K.BuildLock(Path(%r), 'x'): pass\n"
            "except K.UnsafeCache as e: print('refused:', e)\n") % (sys.path, str(slot))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert "refused:" in out.stdout and "not a regular file" in out.stdout, out


def test_another_users_lock_file_is_refused(env):
    slot = K.slot_for(_spec()).dir
    slot.mkdir(parents=True)
    (slot / ".leto-build.flock").write_text("")
    os.chown(slot / ".leto-build.flock", OTHER, OTHER)
    with pytest.raises(K.UnsafeCache, match=f"uid {OTHER}"):
        _obtain()


def test_another_users_complete_slot_is_not_loaded(env):
    got = _obtain()                                   # a complete slot, then given away
    _chown_tree(got.path.parent, OTHER)
    with pytest.raises(K.UnsafeCache) as e:
        _obtain()
    assert str(got.path.parent) in str(e.value) and f"uid {OTHER}" in str(e.value)


def test_a_library_not_ours_or_outside_the_slot_is_rebuilt_not_loaded(env):
    got = _obtain()
    planted = env / "planted.so"
    shutil.copy(got.path, planted)
    (env / "src" / "tiny.cpp").write_text(SRC % 7)    # another build: returns 7
    evil = _obtain().path
    (env / "src" / "tiny.cpp").write_text(SRC % 42)
    shutil.copy(evil, planted)

    os.chown(got.path, OTHER, OTHER)                  # another user's library
    again = _obtain()
    assert again.built and os.stat(again.path).st_uid == 0 and _call(again.path) == 42

    again.path.unlink()                               # a symlink to a library elsewhere
    os.symlink(planted, again.path)
    third = _obtain()
    assert third.built and not third.path.is_symlink()

    man = third.path.parent / K.MANIFEST              # a manifest naming a path outside
    text = man.read_text().replace('"libleto_tiny.so"', '"../../planted.so"')
    man.write_text(text)
    fourth = _obtain()
    assert fourth.built and fourth.path == third.path


def test_a_world_writable_root_is_refused_with_the_fix(env):
    root = K.root()
    root.mkdir(parents=True)
    os.chmod(root, 0o777)
    with pytest.raises(K.UnsafeCache) as e:
        _obtain()
    assert str(root) in str(e.value) and "every user" in str(e.value)
    assert f"chmod go-w {root}" in str(e.value)
    assert not any(root.iterdir())                    # nothing built there


def test_a_group_writable_root_of_a_shared_group_is_refused(env):
    shared = grp.getgrgid(OTHER).gr_name
    root = K.root()
    root.mkdir(parents=True)
    os.chown(root, 0, OTHER)
    os.chmod(root, 0o775)
    with pytest.raises(K.UnsafeCache, match=f"writable by group {OTHER}"):
        _obtain()
    assert shared != "root"


def test_a_root_under_another_users_directory_is_refused(env, monkeypatch):
    theirs = env / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER, OTHER)
    os.symlink(theirs, env / "link")                  # the configured path goes through a link
    monkeypatch.setenv("LETO_EXT_DIR", str(env / "link" / "cache"))
    with pytest.raises(K.UnsafeCache) as e:
        _obtain()
    assert str(theirs) in str(e.value) and f"uid {OTHER}" in str(e.value)
    assert not (theirs / "cache").exists()


def test_a_sticky_world_writable_parent_is_fine(env, monkeypatch):
    tmp = env / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)                              # like /tmp
    monkeypatch.setenv("LETO_EXT_DIR", str(tmp / "leto"))
    got = _obtain()
    assert got.built and _call(got.path) == 42


def test_another_users_stale_torch_lock_is_not_removed(env):
    slot = K.slot_for(_spec()).dir
    slot.mkdir(parents=True)
    (slot / "lock").write_text("")
    os.chown(slot / "lock", OTHER, OTHER)
    assert _obtain().built
    assert (slot / "lock").exists()
