"""Bad input, from every surface (command line, YAML, environment, --inject), is refused before
anything starts: exit 2, one `leto-run: error:` line naming the problem (the key, option or
path) and the fix, no traceback -- and nothing was started or created: the training script
(which would write a marker) never ran, no log directory or event log appeared, and the job's
own TMPDIR is empty (no run directory, no `torchelastic_` log dir).

Every case runs the real `python -m leto_run` in a fresh process with its own TMPDIR and a
clean environment (no PET_*/LETO_* of the caller).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HUGE = "99999999999999999999"
MARKER_SCRIPT = "import pathlib; pathlib.Path(__file__).with_name('STARTED').write_text('ran')\n"
DEEP = "a: " + "[" * 40 + "]" * 40 + "\n"

# id, argv (after `python -m leto_run`), extra env, files to create in the case's directory,
# words the error must contain.  `{d}` is the case's directory, `{s}` the marker script.
CASES = [
    # ---- command line: numbers (items 6 and 10) -----------------------------------------
    ("cli-tier2-0", ["--tier2", "0", "{s}"], {}, {}, ["recovery.tier2 (--tier2)", "tier-2"]),
    ("cli-shutdown-1e300", ["--shutdown-timeout", "1e300", "{s}"], {}, {},
     ["launch.shutdown_timeout (--shutdown-timeout)", "maximum"]),
    ("cli-pg-timeout-1e300", ["--pg-timeout", "1e300", "{s}"], {}, {},
     ["recovery.pg_timeout (--pg-timeout)", "maximum"]),
    ("cli-nproc-huge", ["--nproc-per-node", HUGE, "{s}"], {}, {},
     ["launch.nproc_per_node (--nproc-per-node)", "1024"]),
    ("cli-hang-nan", ["--hang-timeout", "nan", "{s}"], {}, {},
     ["recovery.hang_timeout (--hang-timeout)", "finite"]),
    ("cli-barrier-inf", ["--exit-barrier-timeout", "inf", "{s}"], {}, {},
     ["launch.exit_barrier_timeout (--exit-barrier-timeout)", "finite"]),
    ("cli-monitor-neg-zero", ["--monitor-interval", "-0.0", "{s}"], {}, {},
     ["launch.monitor_interval (--monitor-interval)", "> 0"]),
    ("cli-max-restarts-huge", ["--max-restarts", HUGE + "0000", "{s}"], {}, {},
     ["launch.max_restarts (--max-restarts)", "too large"]),
    ("cli-nnodes-huge", ["--nnodes", "1:99999999", "{s}"], {}, {},
     ["launch.nnodes (--nnodes)", "65536"]),
    ("cli-port", ["--master-port", "70000", "--nnodes", "2", "{s}"], {}, {},
     ["rendezvous.master_port (--master-port)", "1..65535"]),
    ("cli-page-bytes-4tib", ["--page-bytes", str(4 << 40), "{s}"], {}, {},
     ["recovery.page_bytes (--page-bytes)", "maximum"]),
    ("cli-chunk-above-group", ["--data-pages", "32", "--chunk-pages", "64", "{s}"], {}, {},
     ["recovery.chunk_pages (--chunk-pages)", "data_pages=32"]),
    ("cli-budget-huge", ["--max-inplace-recoveries", "10000000", "{s}"], {}, {},
     ["recovery.max_inplace_recoveries (--max-inplace-recoveries)", "maximum"]),
    ("cli-rdzv-timeout-1e300", ["--rdzv-conf", "join_timeout=1e300", "{s}"], {}, {},
     ["rendezvous.conf (--rdzv-conf)", "join_timeout"]),
    ("cli-filter-huge", ["--local-ranks-filter", HUGE, "{s}"], {}, {},
     ["logs.local_ranks_filter (--local-ranks-filter)"]),
    ("cli-int-5000-digits", ["--data-pages", "9" * 5000, "{s}"], {}, {},
     ["recovery.data_pages (--data-pages)", "too large"]),
    ("cli-unicode-digits", ["--nproc-per-node", "\u0663", "{s}"], {}, {},
     ["launch.nproc_per_node (--nproc-per-node)"]),
    # ---- command line: paths and programs (item 8) --------------------------------------
    ("cli-logdir-is-file", ["--log-dir", "{d}/afile", "{s}"], {}, {"afile": b"x"},
     ["logs.log_dir (--log-dir)", "{d}/afile", "not a directory"]),
    ("cli-logdir-under-file", ["--log-dir", "{d}/afile/logs", "{s}"], {}, {"afile": b"x"},
     ["logs.log_dir (--log-dir)", "{d}/afile", "is a file"]),
    ("cli-logdir-unwritable", ["--log-dir", "/proc/leto-bad-input/logs", "{s}"], {}, {},
     ["logs.log_dir (--log-dir)", "/proc/leto-bad-input/logs", "not writable"]),
    ("cli-events-is-dir", ["--events", "{d}/adir", "{s}"], {}, {"adir/": None},
     ["logs.events (--events)", "{d}/adir", "is a directory"]),
    ("cli-events-under-file", ["--events", "{d}/afile/sub/ev.jsonl", "{s}"], {}, {"afile": b"x"},
     ["logs.events (--events)", "{d}/afile", "is a file"]),
    ("cli-events-unwritable-dir", ["--events", "/proc/leto-bad-input/ev.jsonl", "{s}"], {}, {},
     ["logs.events (--events)", "not writable"]),
    ("cli-no-python-missing", ["--no-python", "leto-no-such-program-x"], {}, {},
     ["launch.training_script", "leto-no-such-program-x", "PATH"]),
    # ---- YAML (item 10) -------------------------------------------------------------------
    ("yaml-binary", ["--config", "{d}/job.yaml", "{s}"], {}, {"job.yaml": bytes(range(256))},
     ["config (--config)", "job.yaml", "not UTF-8"]),
    ("yaml-nul", ["--config", "{d}/job.yaml", "{s}"], {}, {"job.yaml": b"launch:\x00\n"},
     ["config ({d}/job.yaml)", "not allowed in YAML"]),
    ("yaml-not-mapping", ["--config", "{d}/job.yaml", "{s}"], {}, {"job.yaml": b"- a\n- b\n"},
     ["config ({d}/job.yaml:1)", "not a mapping"]),
    ("yaml-directory", ["--config", "{d}/adir", "{s}"], {}, {"adir/": None},
     ["config (--config)", "is a directory"]),
    ("yaml-missing", ["--config", "{d}/nope.yaml", "{s}"], {}, {},
     ["config (--config)", "nope.yaml", "No such file"]),
    ("yaml-deep", ["--config", "{d}/job.yaml", "{s}"], {}, {"job.yaml": DEEP.encode()},
     ["config ({d}/job.yaml:1)", "nesting deeper"]),
    ("yaml-duplicate-key", ["--config", "{d}/job.yaml", "{s}"], {},
     {"job.yaml": b"launch:\n  max_restarts: 1\n  max_restarts: 2\n"},
     ["launch.max_restarts ({d}/job.yaml:3)", "duplicate"]),
    ("yaml-tier2-0", ["--config", "{d}/job.yaml", "{s}"], {},
     {"job.yaml": b"recovery:\n  tier2: 0\n"}, ["recovery.tier2 ({d}/job.yaml:2)"]),
    ("yaml-nproc-huge-int", ["--config", "{d}/job.yaml", "{s}"], {},
     {"job.yaml": f"launch:\n  nproc_per_node: {HUGE}\n".encode()},
     ["launch.nproc_per_node ({d}/job.yaml:2)"]),
    ("yaml-timeout-inf", ["--config", "{d}/job.yaml", "{s}"], {},
     {"job.yaml": b"launch:\n  shutdown_timeout: .inf\n"},
     ["launch.shutdown_timeout ({d}/job.yaml:2)", "finite"]),
    ("yaml-data-pages-huge", ["--config", "{d}/job.yaml", "{s}"], {},
     {"job.yaml": b"recovery:\n  data_pages: 1000000000000000000000000000000\n"},
     ["recovery.data_pages ({d}/job.yaml:2)", "too large"]),       # as on the CLI
    ("yaml-int-5000-digits", ["--config", "{d}/job.yaml", "{s}"], {},
     {"job.yaml": ("launch:\n  nproc_per_node: " + "9" * 5000 + "\n").encode()},
     ["launch.nproc_per_node ({d}/job.yaml:2)", "above the maximum"]),   # as on the CLI
    ("yaml-float-huge-int", ["--config", "{d}/job.yaml", "{s}"], {},
     {"job.yaml": ("recovery:\n  pg_timeout: 1" + "0" * 400 + "\n").encode()},
     ["recovery.pg_timeout ({d}/job.yaml:2)", "finite"]),
    # ---- environment (item 10) ------------------------------------------------------------
    ("env-nproc-huge", ["{s}"], {"PET_NPROC_PER_NODE": HUGE}, {},
     ["launch.nproc_per_node (PET_NPROC_PER_NODE)"]),
    ("env-shutdown-1e300", ["{s}"], {"PET_SHUTDOWN_TIMEOUT": "1e300"}, {},
     ["launch.shutdown_timeout (PET_SHUTDOWN_TIMEOUT)", "maximum"]),
    ("env-torch-shutdown-neg", ["{s}"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "-5"}, {},
     ["launch.shutdown_timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT)", ">= 0"]),
    ("env-hang-negative", ["{s}"], {"LETO_HANG_TIMEOUT": "-1"}, {},
     ["recovery.hang_timeout (LETO_HANG_TIMEOUT)", ">= 0"]),
    ("env-tier2-0", ["{s}"], {"PET_TIER2": "0"}, {}, ["recovery.tier2 (PET_TIER2)"]),
    ("env-window-1e300", ["{s}"], {"LETO_INPLACE_WINDOW": "1e300"}, {},
     ["recovery.inplace_window (LETO_INPLACE_WINDOW)", "maximum"]),
    ("env-config-missing", ["{s}"], {"LETO_CONFIG": "{d}/nope.yaml"}, {},
     ["config (LETO_CONFIG)", "nope.yaml"]),
    ("env-events-dir", ["{s}"], {"LETO_EVENTS": "{d}/adir"}, {"adir/": None},
     ["logs.events (LETO_EVENTS)", "is a directory"]),
    ("env-python-exec", ["{s}"], {"PYTHON_EXEC": "{d}/no-python"}, {},
     ["PYTHON_EXEC", "{d}/no-python", "not an executable"]),
    ("cli-script-missing", ["{d}/nope.py"], {}, {},
     ["launch.training_script (TRAINING_SCRIPT)", "{d}/nope.py", "does not exist"]),
    ("cli-script-missing-run-path", ["--run-path", "{d}/nope.py"], {}, {},
     ["launch.training_script", "does not exist"]),
    # ---- --inject that can never fire (item 10) -----------------------------------------
    ("inj-pages-restart", ["--recovery", "restart", "--inject",
                           "pages:rank=0:tier=host:count=1:after=1s", "{s}"], {}, {},
     ["inject[0] (--inject)", "in-place recovery", "--recovery inplace"]),
    ("inj-gen-restart", ["--recovery", "restart", "--inject", "kill:rank=0:step=1:gen=1", "{s}"],
     {}, {}, ["inject[0] (--inject)", "gen=1 never comes"]),
    ("inj-recovery-point-restart", ["--recovery", "restart", "--inject",
                                    "kill:rank=0:step=1:at=recovery.finish", "{s}"], {}, {},
     ["inject[0] (--inject)", "recovery.finish"]),
    ("inj-rank-world", ["--nproc-per-node", "2", "--inject", "kill:rank=2:after=1s", "{s}"],
     {}, {}, ["inject[0] (--inject)", "world size 2"]),
    ("inj-rank-huge", ["--inject", f"kill:rank={HUGE}:after=1s", "{s}"], {}, {},
     ["inject[0] (--inject)", "too large"]),
    ("inj-after-huge", ["--inject", "kill:rank=0:after=1e9s", "{s}"], {}, {},
     ["inject[0] (--inject)", "after="]),
    ("inj-chunk-no-chunks", ["--inject", "kill:rank=0:step=3:at=rmu.load:chunk=1", "{s}"], {},
     {}, ["inject[0] (--inject)", "chunk= never matches at rmu.load"]),
    ("inj-group-at-done", ["--inject", "kill:rank=0:step=3:at=rmu.done:group=0", "{s}"], {},
     {}, ["inject[0] (--inject)", "group= never matches at rmu.done"]),
    ("inj-garbage-commit", ["--inject", "kill:rank=0:step=3:at=rmu.commit:garbage=1", "{s}"],
     {}, {}, ["inject[0] (--inject)", "garbage=1 does nothing at rmu.commit"]),
    ("inj-chunk-beyond", ["--data-pages", "32", "--chunk-pages", "8", "--inject",
                          "kill:rank=0:step=2:at=rmu.update:chunk=4", "{s}"], {}, {},
     ["inject[0] (--inject)", "chunk=4 never comes", "4 chunk(s)"]),
    ("inj-pages-device-parity", ["--inject", "pages:rank=0:tier=device:part=p1:count=1:step=1",
                                 "{s}"], {}, {}, ["inject[0] (--inject)", "host memory"]),
    ("inj-pages-beyond-group", ["--data-pages", "32", "--inject",
                                "pages:rank=0:tier=device:count=40:step=1", "{s}"], {}, {},
     ["inject[0] (--inject)", "pages 0..39 of data do not exist"]),
    ("inj-pages-beyond-tier2", ["--inject", "pages:rank=0:tier=host:part=p2:count=2:step=1",
                                "{s}"], {}, {}, ["inject[0] (--inject)", "tier2=1"]),
    ("inj-hang-no-detection", ["--hang-timeout", "0", "--inject", "hang:rank=0:step=1", "{s}"],
     {}, {}, ["inject[0] (--inject)", "hang detection"]),
    ("inj-gen-no-budget", ["--max-inplace-recoveries", "0", "--inject",
                           "kill:rank=0:step=1:gen=1", "{s}"], {}, {},
     ["inject[0] (--inject)", "max_inplace_recoveries 0"]),
    ("inj-recovery-point-gen0", ["--inject", "kill:rank=0:step=0:at=recovery.localize", "{s}"],
     {}, {}, ["inject[0] (--inject)", "recover nothing"]),
    # ---- checkpoints (issue 20): a directory that cannot take them, settings that contradict
    ("cli-ckpt-dir-unwritable", ["--checkpoint-dir", "/proc/leto-bad-input/ck",
                                 "--checkpoint-every", "3", "{s}"], {}, {},
     ["checkpoint.dir (--checkpoint-dir)", "/proc/leto-bad-input/ck", "not writable"]),
    ("cli-ckpt-every-0", ["--checkpoint-dir", "{d}/ck", "--checkpoint-every", "0", "{s}"], {},
     {}, ["checkpoint.every (--checkpoint-every)", "at least one step"]),
    ("cli-ckpt-every-and-mtbf", ["--checkpoint-dir", "{d}/ck", "--checkpoint-every", "10",
                                 "--ff-mtbf", "6h", "{s}"], {}, {},
     ["checkpoint.ff_mtbf", "contradicts"]),
    ("yaml-ckpt-every-no-dir", ["--config", "{d}/job.yaml", "{s}"], {},
     {"job.yaml": b"checkpoint:\n  every: 10\n"}, ["checkpoint.every", "checkpoint.dir is not"]),
    # ---- preinitialization levels (issue 21) ---------------------------------------------
    ("cli-preinit-l4", ["--preinit", "L4", "{s}"], {}, {},
     ["recovery.preinit (--preinit)", "'L4'", "auto, L1, L2, L3"]),
    ("env-preinit-margin-neg", ["{s}"], {"LETO_PREINIT_MARGIN": "-1"}, {},
     ["recovery.preinit_margin (LETO_PREINIT_MARGIN)"]),
    ("env-preinit-hold-zero", ["{s}"], {"LETO_PREINIT_RAISE_HOLD": "0"}, {},
     ["LETO_PREINIT_RAISE_HOLD", "seconds"]),
    ("env-preinit-control", ["{s}"], {"LETO_PREINIT_CONTROL": "maybe"}, {},
     ["LETO_PREINIT_CONTROL"]),
    ("yaml-preinit-number", ["--config", "{d}/job.yaml", "{s}"], {},
     {"job.yaml": b"recovery:\n  preinit: 3\n"}, ["recovery.preinit"]),
    ("inj-preinit-after", ["--inject", "preinit:rank=0:after=2s:level=L1", "{s}"], {}, {},
     ["inject[0] (--inject)", "start of a step"]),
    ("inj-preinit-restart", ["--recovery", "restart", "--inject",
                             "preinit:rank=0:step=2:level=L1", "{s}"], {}, {},
     ["inject[0] (--inject)", "in-place recovery"]),
    ("inj-preinit-nodes", ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--inject",
                           "preinit:rank=0:step=2:level=L2", "{s}"], {}, {},
     ["inject[0] (--inject)", "single node"]),
    ("inj-preinit-level", ["--inject", "preinit:rank=0:step=2:level=L0", "{s}"], {}, {},
     ["level=L1, L2 or L3"]),
    ("inj-yaml-pages-restart", ["--config", "{d}/job.yaml", "{s}"], {},
     {"job.yaml": b"recovery:\n  mode: restart\ninject:\n  - {kind: pages, rank: 0, tier: host, "
                  b"count: 1, step: 2}\n"}, ["inject[0] ({d}/job.yaml:4)", "in-place recovery"]),
]


def _clean_env(tmpdir: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "LETO_", "TORCHELASTIC_", "TORCH_ELASTIC_"))
           and k not in ("PYTHON_EXEC", "RANK", "WORLD_SIZE")}
    env.update(TMPDIR=str(tmpdir), PYTHONPATH=str(ROOT), **extra)
    return env


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_before_anything_starts(tmp_path, case):
    _, argv, env, files, words = case
    d = tmp_path / "case"
    tmpdir = tmp_path / "tmp"
    d.mkdir()
    tmpdir.mkdir()
    script = d / "train.py"
    script.write_text(MARKER_SCRIPT)
    for name, data in files.items():
        if name.endswith("/"):
            (d / name).mkdir()
        else:
            (d / name).write_bytes(data)
    before = sorted(os.listdir(d))

    def fill(x: str) -> str:
        return x.replace("{d}", str(d)).replace("{s}", str(script))

    r = subprocess.run([sys.executable, "-m", "leto_run", *map(fill, argv)],
                       env=_clean_env(tmpdir, {k: fill(v) for k, v in env.items()}),
                       cwd=str(d), capture_output=True, text=True, timeout=60)
    err = r.stderr
    assert r.returncode == 2, err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("leto-run: error: "), err
    assert " -- fix: " in err and err.split(" -- fix: ")[1].strip(), err
    for w in map(fill, words):
        assert w in err, (w, err)
    assert r.stdout == ""
    # nothing started, nothing created: no script run, no log dir / event log, no run dir
    assert not (d / "STARTED").exists()
    assert sorted(os.listdir(d)) == before
    assert os.listdir(tmpdir) == []
    assert not os.path.exists("/proc/leto-bad-input")


def test_table_covers_every_surface():
    kinds = {c[0].split("-")[0] for c in CASES}
    assert kinds == {"cli", "yaml", "env", "inj"} and len(CASES) >= 30


def test_a_checkpoint_dir_on_a_full_file_system_exits_2(tmp_path):
    """A real full file system: a 64 KiB tmpfs, filled, mounted in a private mount namespace
    (unshare), so nothing outside this test sees it."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a private tmpfs")
    full, tmpdir = tmp_path / "full", tmp_path / "tmp"
    full.mkdir()
    tmpdir.mkdir()
    script = tmp_path / "train.py"
    script.write_text(MARKER_SCRIPT)
    inner = (f"mount -t tmpfs -o size=64k tmpfs {full} && "
             f"(dd if=/dev/zero of={full}/fill bs=4k 2>/dev/null; true) && "
             f"exec {sys.executable} -m leto_run --checkpoint-dir {full}/ck "
             f"--checkpoint-every 3 {script}")
    r = subprocess.run(["unshare", "-rm", "sh", "-c", inner], env=_clean_env(tmpdir, {}),
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    if "mount" in r.stderr and "leto-run" not in r.stderr:
        pytest.skip(f"no private tmpfs here: {r.stderr.strip()}")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("leto-run: error: checkpoint.dir (--checkpoint-dir)"), r.stderr
    assert "full file system" in r.stderr and " -- fix: " in r.stderr, r.stderr
    assert not (tmp_path / "STARTED").exists() and os.listdir(tmpdir) == []
