"""An agent whose construction fails releases what it took (red-team 10).

`Agent.__init__` takes the checkpoint directory's lock, forks the guardian (and the fork server
is forked before it), makes its run directory and heartbeat socket, then builds the rendezvous;
when that step fails for a real reason -- the c10d endpoint's port is taken by another program
and `is_host=1` says this node must host it -- leto-run exits with the typed error and leaves
no lock, no run directory and no process behind (a stale lock would refuse the next job on
that checkpoint directory)."""
import os
import socket
import subprocess
import time

from leto_testing import ROOT, base_env, leto_cmd, with_env


def test_failed_construction_leaves_nothing(out_dir, tmp_path):
    ckpt, tmp = tmp_path / "ckpt", tmp_path / "t"
    ckpt.mkdir()
    tmp.mkdir()
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    with socket.socket() as taken:          # another program holds the port
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(
            leto_cmd("--no-status", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                     f"localhost:{port}", "--rdzv-conf", "is_host=1", "--checkpoint-dir",
                     str(ckpt), "--checkpoint-every", "5", str(script)),
            env=base_env(out_dir, TMPDIR=str(tmp)), cwd=str(ROOT), capture_output=True,
            text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Address already in use" in r.stderr and f"{port}" in r.stderr, r.stderr[-2000:]
    # Released by the agent itself, not left to the guardian's clean-up after a death.
    assert os.listdir(ckpt) == [], os.listdir(ckpt)
    assert os.listdir(tmp) == [], os.listdir(tmp)
    time.sleep(0.3)
    assert with_env(f"OUT_DIR={out_dir}") == []       # guardian, fork server
    # The directory is usable again: the next job's lock is taken and released.
    r2 = subprocess.run(leto_cmd("--no-status", "--standalone", "--checkpoint-dir", str(ckpt),
                                 "--checkpoint-every", "5", str(script)),
                        env=base_env(out_dir, TMPDIR=str(tmp)), cwd=str(ROOT),
                        capture_output=True, text=True, timeout=120)
    assert r2.returncode == 0, r2.stderr[-2000:]
