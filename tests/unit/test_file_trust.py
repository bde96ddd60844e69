"""leto_runtime.wire.file_trust: one verdict on planted entries, over real files (symlinks,
FIFOs, hard links, directories, another user's file), and the same verdict from each of its
callers (the checkpoint lock, the checkpoint directory's entries, the kernel cache)."""
from __future__ import annotations

import os

import pytest

from leto_runtime.wire import ckpt_files, file_trust


def _entries(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"x")
    (tmp_path / "d").mkdir()
    os.symlink(f, tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    os.link(f, tmp_path / "f2")
    return tmp_path


@pytest.mark.parametrize("name,kind,one_link,why", [
    ("link", "file", False, "is a symbolic link"),
    ("fifo", "file", False, "is not a regular file"),
    ("d", "file", False, "is not a regular file"),
    ("f", "dir", False, "is not a directory"),
    ("f", "file", True, "has 2 hard links"),
    ("f", "file", False, None),
    ("d", "dir", False, None),
])
def test_each_planted_kind_is_named(tmp_path, name, kind, one_link, why):
    st = os.lstat(_entries(tmp_path) / name)
    got = file_trust.problem(st, kind, one_link=one_link)
    assert got is None if why is None else why in got, got


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_another_user_s_entry_is_refused_unless_its_owner_is_allowed(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"x")
    os.chown(f, 4242, 4242)
    assert "belongs to another user (uid 4242)" in file_trust.problem(os.lstat(f))
    assert file_trust.problem(os.lstat(f), owners=(4242,)) is None
    d = tmp_path / "step_000000003"
    d.mkdir()
    os.chown(d, 4242, 4242)
    assert "belongs to another user (uid 4242)" in ckpt_files.foreign(str(d))


def test_the_checkpoint_lock_and_directory_give_the_same_verdicts(tmp_path):
    from leto_run import ckpt_lock
    from leto_run.errors import ConfigError
    root = _entries(tmp_path)
    assert "is a symbolic link" in ckpt_files.foreign(str(root / "link"))
    assert "is not a directory" in ckpt_files.foreign(str(root / "f"))
    lock = tmp_path / "ck"
    lock.mkdir()
    os.link(root / "f", lock / ckpt_lock.LOCK_NAME)
    with pytest.raises(ConfigError, match="hard links"):
        ckpt_lock.check_path(str(lock))
