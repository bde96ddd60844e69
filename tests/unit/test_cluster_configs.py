"""The cluster examples (configs/cluster/) and the exit-code table of docs/CLUSTERS.md are true
to the code: the sbatch script is valid bash, the manifest parses, each leto-run command line
in them is accepted by leto-run's own config loader (parse only, placeholder values for the
variables Slurm and Kubernetes fill in), the requeue / podFailurePolicy rules use exactly the
table's fatal and retriable codes, and the table lists exactly the exit codes the code defines."""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

import leto_run.procs
from leto_run import errors as E
from leto_run import job_secret
from leto_run.supervisor import SHUTDOWN_SIGNALS
from leto_run.cli import load_config
from leto_run.state_manager import __main__ as sm_main
from leto_runtime.wire import contract

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "configs" / "cluster" / "slurm.sbatch"
JOBSET = ROOT / "configs" / "cluster" / "jobset.yaml"
CLUSTERS = ROOT / "docs" / "CLUSTERS.md"
SCRIPT_ARGS = ["train.py", "--lr", "3e-4"]


# ---- the exit-code tables ------------------------------------------------------------------
def table_rows(md: Path, heading: str) -> list[list[str]]:
    """The body rows of the first table under `heading` (cells stripped, backticks removed)."""
    lines = md.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#") and heading in line)
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append([c.strip().replace("`", "") for c in line.strip().strip("|").split("|")])
        elif rows:
            break
    assert len(rows) > 2, f"no table under {heading!r} in {md}"
    return rows[2:]          # header and separator


def leto_run_codes() -> set[str]:
    """Every exit code `leto-run` itself can end with, from the code: leto_run.errors' EXIT_*
    constants and StoppedBySignal's 128+N."""
    codes = {str(v) for k, v in vars(E).items() if k.startswith("EXIT_")}
    assert E.StoppedBySignal(15).exit_code == 128 + 15
    return codes | {"128+N"}


def signal_codes() -> set[int]:
    """The concrete 128+N: the signals after which leto-run stops the job and exits."""
    return {128 + int(s) for s in SHUTDOWN_SIGNALS}


def table() -> dict[str, list[str]]:
    return {r[0]: r for r in table_rows(CLUSTERS, "Exit codes of leto-run")}


def classes() -> tuple[set[int], set[int]]:
    """(fatal, retriable) concrete codes, as the table says; 128+N expanded."""
    fatal, retriable = set(), set()
    for code, row in table().items():
        kind = row[2].lower()
        values = signal_codes() if code == "128+N" else {int(code)}
        if kind.startswith("fatal"):
            fatal |= values
        elif kind.startswith("retriable"):
            retriable |= values
        else:
            assert code == "0", row
    return fatal, retriable


def test_table_lists_exactly_the_exit_codes_of_leto_run():
    assert set(table()) == leto_run_codes()
    fatal, retriable = classes()
    assert fatal == {E.EXIT_USAGE, E.EXIT_CONTROL_FORGED}
    assert not fatal & retriable and E.EXIT_OK not in fatal | retriable


def test_table_lists_exactly_the_exit_codes_inside_the_job():
    rows = table_rows(CLUSTERS, "Exit codes inside the job")
    got = {(r[0], int(r[1])) for r in rows}
    want = {("trainer", contract.UNRECOVERABLE_EXIT), ("worker", 137)}
    want |= {("state manager", 0)} | {("state manager", getattr(sm_main, n))
                                      for n in dir(sm_main) if n.startswith("EXIT_")}
    assert got == want
    # 137 is the one literal exit code of the launcher's process mechanics (procs._child_setup).
    src = Path(leto_run.procs.__file__).read_text()
    assert re.findall(r"os\._exit\((\d+)\)", src) == ["137"]


def test_no_other_literal_exit_codes_in_the_code():
    """A new `os._exit(<number>)` / `sys.exit(<number>)` must be added to a table."""
    known = {int(c) for c in leto_run_codes() if c.isdigit()} | {contract.UNRECOVERABLE_EXIT, 137}
    for pkg in ("leto_run", "leto_runtime"):
        for p in (ROOT / pkg).rglob("*.py"):
            for n in re.findall(r"(?:os\._exit|sys\.exit)\((\d+)\)", p.read_text()):
                assert int(n) in known, f"{p.relative_to(ROOT)}: exit code {n} is in no table"


def test_kubernetes_column_matches_the_classes():
    for code, row in table().items():
        k8s = row[4]
        if code == "0":
            continue
        want = "FailJob" if row[2].lower().startswith("fatal") else "Count"
        assert k8s.startswith(want), row


# ---- Slurm ---------------------------------------------------------------------------------
def shell_commands(text: str) -> list[str]:
    """Logical lines of a shell script: continuations joined, comments dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        s = line.split(" #", 1)[0].rstrip() if not line.lstrip().startswith("#") else ""
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        cur += s
        if cur.strip():
            out.append(cur.strip())
        cur = ""
    return out


def leto_argv(tokens: list[str], values: dict[str, list[str] | str]) -> list[str]:
    """The arguments after `leto-run` up to the end of its command, every $VAR replaced by
    `values` (a list value expands to several words, as "$@" does); unknown variables fail."""
    i = tokens.index("leto-run")
    argv = []
    for tok in tokens[i + 1:]:
        if tok in ("&", "&&", "||", ";", "|"):
            break
        if tok == "$@":
            argv += list(values["@"])
            continue

        def sub(m):
            name = m.group(1) or m.group(2)
            assert name in values, f"no placeholder for ${name} in {tok!r}"
            return str(values[name])
        argv.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)", sub, tok))
    return argv


def secret_file(tmp_path: Path) -> Path:
    p = tmp_path / "job_secret"
    p.write_bytes(os.urandom(32))
    p.chmod(0o600)
    return p


def test_sbatch_is_valid_bash():
    r = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_sbatch_directives():
    text = SBATCH.read_text()
    directives = re.findall(r"^#SBATCH (\S+)", text, re.M)
    assert "--signal=B:USR1@120" in directives and "--requeue" in directives
    assert "--ntasks-per-node=1" in directives          # one leto-run per node


def test_sbatch_leto_run_command_is_accepted(tmp_path):
    cmds = [c for c in shell_commands(SBATCH.read_text()) if "leto-run" in shlex.split(c)]
    assert len(cmds) == 1, cmds
    secret = secret_file(tmp_path)
    argv = leto_argv(shlex.split(cmds[0]), {
        "SLURM_JOB_NUM_NODES": "2", "head": "node001", "rdzv_id": "4242-0",
        "secret": str(secret), "SLURM_SUBMIT_DIR": str(tmp_path), "@": SCRIPT_ARGS})
    cfg = load_config(argv, env={})
    la, rz = cfg.launch, cfg.rendezvous
    assert (la.min_nodes, la.max_nodes, la.nproc_per_node) == (2, 2, "gpu")
    assert (rz.backend, rz.endpoint, rz.id) == ("c10d", "node001:29400", "4242-0")
    assert "SIGUSR1" in la.signals_to_handle and "SIGTERM" in la.signals_to_handle
    assert cfg.recovery.mode == "inplace"
    assert (la.training_script, la.script_args) == ("train.py", ("--lr", "3e-4"))
    # The multi-node in-place key rule (own id, a usable secret file) is met: a key results.
    assert len(job_secret.job_key(cfg)) == 32


def test_sbatch_requeue_rule_matches_the_table():
    fatal, _ = classes()
    m = re.search(r'case "\$rc" in\n(.*?)\nesac', SBATCH.read_text(), re.S)
    arms = dict(re.findall(r"^\s*([0-9|]+)\)\s*(.*)$", m.group(1), re.M))
    assert set(arms) == {"0", "|".join(str(c) for c in sorted(fatal))}
    assert "exit 0" in arms["0"] and "scontrol requeue" not in " ".join(arms.values())


# ---- Kubernetes ----------------------------------------------------------------------------
def jobset() -> dict:
    docs = [d for d in yaml.safe_load_all(JOBSET.read_text()) if d]
    assert [d["kind"] for d in docs] == ["JobSet"]
    return docs[0]


def test_jobset_parses_and_restarts_together():
    js = jobset()
    (rj,) = js["spec"]["replicatedJobs"]
    job = rj["template"]["spec"]
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and job["backoffLimit"] == 0
    assert js["spec"]["failurePolicy"]["rules"] == [
        {"action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]


def test_jobset_pod_failure_policy_matches_the_table():
    fatal, retriable = classes()
    job = jobset()["spec"]["replicatedJobs"][0]["template"]["spec"]
    (container,) = job["template"]["spec"]["containers"]
    rules = {r["action"]: r["onExitCodes"] for r in job["podFailurePolicy"]["rules"]}
    assert set(rules) == {"FailJob", "Count"}
    for action, codes in (("FailJob", fatal), ("Count", retriable)):
        assert rules[action]["containerName"] == container["name"]
        assert rules[action]["operator"] == "In" and set(rules[action]["values"]) == codes


def test_jobset_leto_run_command_is_accepted(tmp_path):
    js = jobset()
    name, rj = js["metadata"]["name"], js["spec"]["replicatedJobs"][0]
    (container,) = rj["template"]["spec"]["template"]["spec"]["containers"]
    cmd = container["command"]
    assert cmd[:2] == ["bash", "-c"]
    # Kubernetes fills the fieldRef variables; these are placeholders of the same shape.
    filled = {"PET_NODE_RANK": "1", "JOB_UID": "5f0c3c3e-9d2a-4b7e-8a61-2f4d1c0b9e77"}
    env = {}
    for e in container["env"]:
        env[e["name"]] = e["value"] if "value" in e else filled[e["name"]]
    argv = leto_argv(shlex.split(cmd[2]), {"JOB_UID": env["JOB_UID"]})
    cfg = load_config(argv, env=env)
    la, rz = cfg.launch, cfg.rendezvous
    # What leto-run read from torchrun's PET_* variables (Kubeflow Trainer injects the same).
    assert (la.max_nodes, la.nproc_per_node, la.node_rank) == (2, "8", 1)
    assert (rz.backend, rz.master_addr, rz.master_port) == ("static", env["PET_MASTER_ADDR"], 29500)
    assert rz.endpoint == f"{env['PET_MASTER_ADDR']}:29500"
    assert rz.id == env["JOB_UID"] and cfg.recovery.mode == "inplace"
    # PET_MASTER_ADDR names pod 0 as JobSet's DNS hostnames do: <jobset>-<job>-0-0.<subdomain>.
    sub = js["spec"]["network"].get("subdomain", name)
    assert env["PET_MASTER_ADDR"] == f"{name}-{rj['name']}-0-0.{sub}"
    assert js["spec"]["network"]["enableDNSHostnames"] is True
    # The key rule of a multi-node in-place job holds (with a secret file of this machine).
    cfg = cfg.replace(rendezvous=dataclasses.replace(rz, secret_file=str(secret_file(tmp_path))))
    assert len(job_secret.job_key(cfg)) == 32


@pytest.mark.parametrize("path", [SBATCH, JOBSET])
def test_cluster_files_point_into_the_docs(path):
    assert "docs/CLUSTERS.md" in path.read_text()


@pytest.mark.parametrize("path,lang", [(SBATCH, "bash"), (JOBSET, "yaml")])
def test_docs_show_the_files_as_they_are(path, lang):
    blocks = re.findall(rf"```{lang}\n(.*?)```", CLUSTERS.read_text(), re.S)
    assert path.read_text() in blocks, f"docs/CLUSTERS.md does not show {path.name} as it is"


# ---- the sbatch script's control flow, with stand-ins for srun, scontrol and scancel ----------
FAKES = {
    "scontrol": 'echo "scontrol $*" >> "$FAKE_LOG"\n'
                '[ "$1" = show ] && printf "node001\\nnode002\\n"\nexit 0\n',
    "scancel": 'echo "scancel $*" >> "$FAKE_LOG"\nexit 0\n',
    "srun": 'echo "srun $*" >> "$FAKE_LOG"\n'
            'if [ -n "${FAKE_WAIT:-}" ]; then while [ ! -e "$FAKE_WAIT" ]; do sleep 0.02; done; fi\n'
            'exit "$FAKE_RC"\n',
}


def slurm_env(tmp_path: Path, rc: int, **extra) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in FAKES.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path / "home"),
           "FAKE_LOG": str(tmp_path / "log"), "FAKE_RC": str(rc), "SAVE_S": "0",
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_NODELIST": "node[001-002]", "SLURM_SUBMIT_DIR": str(tmp_path)}
    env.update(extra)
    return env


def calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("rc,requeued", [(0, False), (1, True), (2, False), (3, True), (4, True),
                                         (5, False), (143, True)])
def test_sbatch_requeues_exactly_the_retriable_codes(tmp_path, rc, requeued):
    r = subprocess.run(["bash", str(SBATCH), "train.py", "--lr", "3e-4"],
                       env=slurm_env(tmp_path, rc), capture_output=True, text=True, timeout=30)
    assert r.returncode == rc, r.stderr
    log = calls(tmp_path)
    srun = [c for c in log if c.startswith("srun ")]
    assert len(srun) == 1 and " leto-run " in srun[0] and "--rdzv-id 4242-0 " in srun[0]
    assert "--rdzv-endpoint node001:29400" in srun[0] and srun[0].endswith("train.py --lr 3e-4")
    assert ("scontrol requeue 4242" in log) == requeued, log
    _, retriable = classes()
    assert requeued == (rc in retriable)                   # the table's classes, exactly
    # The job's secret was created once, private, of a usable size.
    secret = tmp_path / "home" / ".config" / "leto" / "job_secret"
    assert secret.stat().st_mode & 0o777 == 0o600 and secret.stat().st_size == 32


def test_sbatch_requeue_is_bounded(tmp_path):
    r = subprocess.run(["bash", str(SBATCH)], env=slurm_env(tmp_path, 3, SLURM_RESTART_COUNT="3"),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 3
    log = calls(tmp_path)
    assert not [c for c in log if c.startswith("scontrol requeue")], log
    assert any("--rdzv-id 4242-3 " in c for c in log)        # a requeued run has a fresh id


def test_sbatch_forwards_the_preemption_notice_then_requeues(tmp_path):
    go = tmp_path / "srun_may_exit"
    p = subprocess.Popen(["bash", str(SBATCH)], env=slurm_env(tmp_path, 143, FAKE_WAIT=str(go)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not any(c.startswith("srun ") for c in calls(tmp_path)):
            assert time.monotonic() < deadline and p.poll() is None, p.communicate()
            time.sleep(0.02)
        p.send_signal(signal.SIGUSR1)                    # what --signal=B:USR1@120 sends
        while "scontrol requeue 4242" not in calls(tmp_path):
            assert time.monotonic() < deadline and p.poll() is None, p.communicate()
            time.sleep(0.02)
        assert "scancel --signal=USR1 4242" in calls(tmp_path)
        go.touch()                                       # Slurm stopped the steps: leto-run 143
        _, err = p.communicate(timeout=20)
        assert p.returncode == 143, err
        assert calls(tmp_path).count("scontrol requeue 4242") == 1   # requeued once, not again
    finally:
        p.kill()
