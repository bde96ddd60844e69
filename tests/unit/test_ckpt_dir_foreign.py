"""Entries of --checkpoint-dir that Leto did not write (another user's directory named like a
checkpoint, a symlink to one) are never chosen, loaded or removed (leto_runtime/wire/ckpt_files.py
`foreign`): the scan skips them with one warning naming them; rotation keeps them."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from leto_runtime import ckpt_writer
from leto_runtime.wire import ckpt_files as F

OTHER_UID = 65534          # nobody

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def _write(d: str, step: int, keep: int = 5) -> str:
    """A real checkpoint of ours, written by the trainers' writer."""
    s = F.Settings(directory=d, keep=keep)
    got = ckpt_writer.write({"w": torch.full((4,), float(step))}, step, s, 1, lambda *a, **k: None,
                            lambda p, t: None, stall=0.0, why="test", extra={})
    assert got["ok"], got
    return got["path"]


def _chown_tree(path: str, uid: int) -> None:
    for top, dirs, files in os.walk(path):
        os.chown(top, uid, uid)
        for f in files:
            os.chown(os.path.join(top, f), uid, uid)


@pytest.fixture
def planted(tmp_path):
    """DIR with our step 3, another user's complete-looking step 9999 and a symlink step 9998
    to a complete checkpoint outside DIR."""
    d, elsewhere = str(tmp_path / "ckpt"), str(tmp_path / "elsewhere")
    ours = _write(d, 3)
    theirs = _write(elsewhere, 9999)
    os.rename(theirs, os.path.join(d, F.name(9999)))
    _chown_tree(os.path.join(d, F.name(9999)), OTHER_UID)
    target = _write(elsewhere, 9998)
    os.symlink(target, os.path.join(d, F.name(9998)))
    F._warned.clear()
    return d, ours, target


def test_newest_skips_foreign_and_symlink(planted, caplog):
    d, ours, _ = planted
    with caplog.at_level(logging.WARNING, logger="leto.checkpoint"):
        assert F.newest(d).path == ours
        assert [f.path for f in F.scan(d)] == [ours]
    warned = [r.getMessage() for r in caplog.records if r.name == "leto.checkpoint"]
    assert len(warned) == 1, warned                  # once, though scanned twice
    assert F.name(9999) in warned[0] and f"uid {OTHER_UID}" in warned[0]
    assert F.name(9998) in warned[0] and "symbolic link" in warned[0]


def test_check_refuses_foreign_paths(planted):
    d, _, target = planted
    assert F.check(target).complete                  # the symlink's target itself is ours
    for p in (os.path.join(d, F.name(9998)), os.path.join(d, F.name(9998)) + "/"):
        got = F.check(p)
        assert not got.complete and "symbolic link" in got.reason, p
    got = F.check(os.path.join(d, F.name(9999)))
    assert not got.complete and f"uid {OTHER_UID}" in got.reason


def test_rotation_never_removes_foreign(planted):
    d, ours, target = planted
    foreign_partial = os.path.join(d, F.partial_name(2, 999999, "00000000"))
    os.mkdir(foreign_partial)
    os.chown(foreign_partial, OTHER_UID, OTHER_UID)
    newer = [_write(d, t, keep=1) for t in (4, 5)]    # each write rotates with keep=1
    assert sorted(os.listdir(d)) == sorted([F.name(5), F.name(9998), F.name(9999),
                                            os.path.basename(foreign_partial)])
    assert not os.path.exists(ours) and os.path.isdir(newer[-1])
    assert os.path.isfile(os.path.join(d, F.name(9999), F.MANIFEST))
    assert F.check(target).complete                  # the symlink's target is untouched
    assert F.newest(d).path == newer[-1]


def test_writer_does_not_adopt_a_planted_step(tmp_path):
    """A complete-looking step planted under the name our write renames to: the writer's
    "written by another writer meanwhile" path must not report it as our checkpoint."""
    d, elsewhere = str(tmp_path / "ckpt"), str(tmp_path / "elsewhere")
    os.makedirs(d)
    os.rename(_write(elsewhere, 7), os.path.join(d, F.name(7)))
    _chown_tree(os.path.join(d, F.name(7)), OTHER_UID)
    s = F.Settings(directory=d, keep=2)
    got = ckpt_writer.write({"w": torch.zeros(4)}, 7, s, 1, lambda *a, **k: None, lambda p, t: None,
                            stall=0.0, why="test", extra={})
    assert not got["ok"]
    assert os.stat(os.path.join(d, F.name(7))).st_uid == OTHER_UID
    assert F.newest(d) is None


def test_writer_does_not_replace_another_users_empty_step(tmp_path):
    """rename(2) would replace an empty directory of that name; the writer never does."""
    d = tmp_path / "ckpt"
    d.mkdir()
    os.chmod(d, 0o777)                                # a shared, non-sticky directory
    theirs = d / F.name(5)
    theirs.mkdir()
    os.chown(theirs, OTHER_UID, OTHER_UID)
    s = F.Settings(directory=str(d), keep=2)
    got = ckpt_writer.write({"w": torch.zeros(4)}, 5, s, 1, lambda *a, **k: None, lambda p, t: None,
                            stall=0.0, why="test", extra={})
    assert not got["ok"]
    assert os.stat(theirs).st_uid == OTHER_UID and os.listdir(theirs) == []
    assert [e for e in os.listdir(d) if e != F.name(5)] == []       # our partial is gone


def test_rename_noreplace_keeps_what_is_there(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    with pytest.raises(FileExistsError):
        F.rename_noreplace(str(a), str(b))
    assert a.is_dir() and b.is_dir()
    b.rmdir()
    F.rename_noreplace(str(a), str(b))
    assert b.is_dir() and not a.exists()


def test_the_agents_fallback_picks_our_newest(planted):
    """The agent's side (leto_run/fallback.py) reads the same scan: its choice for a fallback
    and for a restarted group is our step 3, not the planted 9999 / 9998."""
    from leto_run.config_checkpoint import CheckpointConfig
    from leto_run.fallback import FallbackPolicy
    d, ours, _ = planted
    pol = FallbackPolicy(None, CheckpointConfig(dir=d, every="10"), None)
    assert pol.newest() == ours
