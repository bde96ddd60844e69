"""A named secret file is checked on a single node too (`job_secret.job_key`): a missing,
non-regular or group/other-readable file is a ConfigError -- exit 2 before anything starts --
instead of being silently ignored until the job runs on several nodes."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from leto_run import job_secret
from leto_run.config_load import build_config
from leto_run.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def cfg(env):
    return build_config(env={"PET_STANDALONE": "1", **env}, cli_values={"training_script": "x.py"},
                        cli_given={"training_script"})


def secret(tmp_path, mode=0o600, size=32) -> str:
    p = tmp_path / "job_secret"
    p.write_bytes(os.urandom(size))
    p.chmod(mode)
    return str(p)


@pytest.mark.parametrize("make, words", [
    (lambda t: str(t / "nonexistent"), "cannot be opened"),
    (lambda t: str(t), "is not a regular file"),
    (lambda t: secret(t, mode=0o644), "chmod 600"),
    (lambda t: secret(t, size=8), "has 8 bytes"),
])
def test_a_bad_named_secret_file_is_a_config_error_on_one_node(tmp_path, make, words):
    c = cfg({"LETO_SECRET_FILE": make(tmp_path)})
    assert c.launch.max_nodes == 1
    with pytest.raises(ConfigError) as ei:
        job_secret.job_key(c)
    assert ei.value.key == job_secret.KEY and words in str(ei.value)


def test_a_good_secret_file_is_accepted_and_the_key_stays_fresh_per_job(tmp_path):
    c = cfg({"LETO_SECRET_FILE": secret(tmp_path)})
    a, b = job_secret.job_key(c), job_secret.job_key(c)
    assert len(a) == len(b) == job_secret.KEY_BYTES and a != b


def test_no_secret_file_on_one_node_needs_none(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))      # no ~/.config/leto/job_secret here
    assert len(job_secret.job_key(cfg({}))) == job_secret.KEY_BYTES


def test_leto_run_exits_2_before_anything_starts(tmp_path):
    """The red team's case: `--secret-file /nonexistent` on one node ran the job."""
    script = tmp_path / "t.py"
    script.write_text("raise SystemExit(0)\n")
    p = subprocess.run([sys.executable, "-m", "leto_run", "--standalone", "--secret-file",
                        str(tmp_path / "nonexistent"), "--log-dir", str(tmp_path / "logs"),
                        str(script)], cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "rendezvous.secret_file" in p.stderr and "fix:" in p.stderr
    assert not (tmp_path / "logs").exists()
