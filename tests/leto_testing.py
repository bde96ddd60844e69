"""Shared test helpers: run real `leto-run` / `torchrun` processes with timeouts.

Imported by tests as `from leto_testing import ...` (tests/ is on sys.path through
tests/conftest.py).  Not named conftest: several conftest modules exist (tests/gpu has one),
and `from conftest import` would pick whichever was imported first."""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "integration" / "scripts"


_KERNELS: dict = {}


def _kernel_build_results(cuda: bool | None, parallel: bool = True) -> list[tuple[str, str, float, str]]:
    """(name, status, seconds, path or why) of every kernel this machine can use, built now or
    loaded from the cache: `leto_runtime.kernel_build.build_all` (or the older `kernel_cache.build_all`) where it exists, else the
    loaders themselves (`parity._ext.load_cpu`; with CUDA `load_cuda` and `rmu.fused.load`)."""
    import importlib.util
    import time

    if importlib.util.find_spec("leto_runtime.kernel_build") is not None:
        from leto_runtime.kernel_build import build_all
    elif importlib.util.find_spec("leto_runtime.wire.kernel_cache") is not None:
        from leto_runtime.wire.kernel_cache import build_all
    else:
        build_all = None
    if build_all is not None:
        return [(str(b.name), str(b.status), float(b.seconds or 0.0),
                 str(getattr(b, "why", None) or getattr(b, "path", None) or ""))
                for b in (build_all(cuda=cuda, parallel=parallel) if parallel is False
                          else build_all(cuda=cuda))]
    import torch

    from leto_runtime.parity import _ext
    from leto_runtime.parity.errors import ParityBackendUnavailable
    usable = torch.version.cuda is not None and torch.cuda.is_available()
    loaders = [("leto_parity_cpu", _ext.load_cpu)]
    cuda_loaders = [("leto_parity_cuda", _ext.load_cuda)]
    try:
        from leto_runtime.rmu import fused
        cuda_loaders.append(("leto_rmu_cuda", fused.load))
    except ImportError:
        pass
    out, skipped = [], []
    if cuda or (cuda is None and usable):
        loaders += cuda_loaders
    else:
        why = "asked for CPU kernels only" if cuda is False else \
            f"no CUDA here (torch {torch.__version__}, CUDA {torch.version.cuda})"
        skipped = [(name, "skipped", 0.0, why) for name, _ in cuda_loaders]
    for name, load in loaders:
        try:
            cached = any((_ext._build_root() / name).glob(f"{name}*.so"))
        except Exception:
            cached = False
        t0 = time.monotonic()
        try:
            mod = load()
            status, where = ("cached" if cached else "built"), str(getattr(mod, "__file__", ""))
        except ParityBackendUnavailable as e:
            status, where = "failed", str(e)
        out.append((name, status, time.monotonic() - t0, where))
    return out + skipped


def build_kernels(config=None, *, cuda: bool | None = None, what: str = "") -> list[tuple]:
    """Build (or load from the cache) the kernels once per session, before any test, and say
    what was built (tests/conftest.py, tests/gpu/conftest.py: `pytest_sessionstart`, outside
    every per-test timeout).  A failed build does not stop the session: the tests that need the
    kernel fail or skip with the reason themselves."""
    import sys
    import time

    key = "auto" if cuda is None else bool(cuda)
    if key in _KERNELS:
        return _KERNELS[key]
    auto = _KERNELS.get("auto")
    if cuda and auto and not any(s in ("skipped", "failed") for _, s, _, _ in auto):
        return auto                 # the session's first build already covered the CUDA kernels
    t0 = time.monotonic()
    # An xdist worker starts after the controller's session start built everything: it only
    # loads from the cache, in process (no child builders per worker).
    worker = config is not None and hasattr(config, "workerinput")
    try:
        res = _kernel_build_results(cuda, parallel=not worker)
    except Exception as e:                       # report it; the tests that need it will fail
        res = [("kernels", "failed", time.monotonic() - t0, f"{type(e).__name__}: {e}")]
    _KERNELS[key] = res
    tr = config.pluginmanager.get_plugin("terminalreporter") if config is not None else None
    lines = [f"leto kernels ({what or 'session start'}, {time.monotonic() - t0:.1f} s): "
             + ", ".join(f"{n} {s}" + (f" in {sec:.0f} s" if s == "built" else "")
                         for n, s, sec, _ in res)]
    for why in dict.fromkeys(w for _, s, _, w in res if s == "skipped"):
        names = ", ".join(n for n, s, _, w in res if s == "skipped" and w == why)
        lines.append(f"  skipped ({names}): {why}")
    lines += [f"  {n} failed: {w[:1000]}" for n, s, _, w in res if s == "failed"]
    for line in lines:
        if tr is not None:
            tr.write_line(line)
        else:
            print(line, file=sys.stderr, flush=True)
    return res


_PORT_BAND = 500
_next_port = [random.randrange(_PORT_BAND)]     # another test run on the machine starts elsewhere


@contextlib.contextmanager
def tiny_tmpfs(prefix: str, size: str = "64k"):
    """A fresh tmpfs of `size` mounted on a new directory (a real full disk for the tests);
    unmounted and removed whatever the test did.  Skips the test where mounting needs root."""
    import pytest
    import tempfile
    d = tempfile.mkdtemp(prefix=prefix)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", d],
                       capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", d], check=True)
        os.rmdir(d)


def job_secret_file(d: Path) -> Path:
    """A fresh 0600 job secret under `d`, as every node of a multi-node test shares it."""
    secret = d / "job_secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    return secret


def listening(port: int) -> bool:
    """Does something accept on 127.0.0.1:`port` (the agent hosting the rendezvous)?"""
    with socket.socket() as c:
        return c.connect_ex(("127.0.0.1", port)) == 0


def free_port() -> int:
    """A free TCP port on 127.0.0.1 that no other test of the run can be handed meanwhile:
    taken below the kernel's ephemeral range (where bind(0), every store bound to port 0 and
    every outgoing connection take theirs), from a band of this xdist worker's own, in turn
    from a random start, skipping any port something on the machine has bound.  (A port from
    bind(0) is free only until the caller closes it: another test's bind(0) can be handed it
    before the test's process binds it.)"""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    w = int(worker[2:]) if worker[2:].isdigit() else 0
    start = max(1024, low - (w + 1) * _PORT_BAND)
    for _ in range(_PORT_BAND):
        port = start + _next_port[0] % _PORT_BAND
        _next_port[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:          # every port of the band taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shared_dir(tmp_path_factory, name: str, build, wait_s: float = 900.0) -> Path:
    """The directory `name`, built once per test run by `build(path)` -- by whichever xdist
    worker asks first, while the others wait on its lock and then reuse it.  For fault-free
    reference runs: each is a pure function of its name, read (never written) by the tests."""
    import fcntl
    import shutil

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent                       # the run's folder, shared by its workers
    root = root / "shared"
    root.mkdir(exist_ok=True)
    d = root / name
    with open(root / f"{name}.lock", "a+") as lock:
        end = time.monotonic() + wait_s
        while True:                  # bounded: the builder's own run has a timeout below this
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > end:
                    raise TimeoutError(f"{name}: another worker has been building it for "
                                       f"{wait_s:g} s") from None
                time.sleep(0.2)
        try:
            if (d / ".complete").exists():
                return d
            shutil.rmtree(d, ignore_errors=True)  # a build that failed in another worker
            d.mkdir()
            build(d)
            (d / ".complete").touch()
            return d
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def base_env(out_dir: Path | None = None, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if (not k.startswith(("PET_", "LETO_", "TORCHELASTIC_")) or k.startswith("LETO_EXT_"))
           and k not in ("RANK", "WORLD_SIZE")}      # LETO_EXT_*: the kernel build cache
    env["PYTHONUNBUFFERED"] = "1"
    if out_dir is not None:
        env["OUT_DIR"] = str(out_dir)
    env.update(extra)
    return env


def leto_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "leto_run", *args]


def torchrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def run(cmd: list[str], env: dict[str, str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """`cmd` to its end; past `timeout` the failure shows the tail of what it printed (a
    timeout is a hang to explain, and subprocess's own error shows nothing of it)."""
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=str(ROOT), **kw)
    except subprocess.TimeoutExpired as e:
        def tail(b):
            return (b.decode(errors="replace") if isinstance(b, bytes) else (b or ""))[-4000:]
        raise AssertionError(f"{' '.join(map(str, cmd))} did not end in {timeout} s\n"
                             f"--- stdout (tail)\n{tail(e.stdout)}\n--- stderr (tail)\n"
                             f"{tail(e.stderr)}") from None


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def of(evs: list[dict], name: str, **match) -> list[dict]:
    """The events named `name` whose fields equal `match`."""
    return [e for e in evs if e["event"] == name and all(e.get(k) == v for k, v in match.items())]


def assert_nothing_left(evs: list[dict]) -> None:
    """Every process the agent spawned (per the event log) is gone, and its exit was recorded
    once: never twice, and, when the job ended, for every trainer (whoever saw the exit --
    its pidfd, a kill by a policy, or the final stop: `WorkerGroup.recorded_exit`)."""
    pids = [e["pid"] for e in evs if e["event"] == "spawn"]
    assert pids and not [p for p in pids if pid_alive(p)]
    exits: dict[int, int] = {}
    for e in evs:
        if e["event"] == "exit":
            exits[e["pid"]] = exits.get(e["pid"], 0) + 1
    assert not {p: n for p, n in exits.items() if n > 1}, "exit recorded more than once"
    if any(e["event"] == "job_end" for e in evs):
        trainers = {e["pid"] for e in evs
                    if e["event"] == "spawn" and e.get("role") not in ("state_manager", "fork_server")}
        assert trainers <= set(exits), f"no exit recorded for {sorted(trainers - set(exits))}"


def event_waiter(p: subprocess.Popen, ev: Path, end: float):
    """`wait_for(pred, what)`: poll the event log `ev` of the running job `p` until `pred(events)`
    is truthy (returned), failing if the job ends or the monotonic deadline `end` passes."""
    def wait_for(pred, what: str):
        while True:
            assert p.poll() is None, f"leto-run ended while waiting for {what}"
            assert time.monotonic() < end, f"timed out waiting for {what}"
            found = pred(events(ev)) if ev.exists() else None
            if found:
                return found
            time.sleep(0.05)
    return wait_for


def kill_state_manager_until_gone(ev: Path, wait_for, local_rank: int) -> set[int]:
    """SIGKILL each new state manager of slot `local_rank` as soon as it is spawned, until the
    agent gives the slot up (`sm_gone`); returns the pids killed."""
    killed: set[int] = set()
    while not of(events(ev), "sm_gone"):
        for e in of(events(ev), "spawn", role="state_manager", local_rank=local_rank):
            if e["pid"] not in killed:
                os.kill(e["pid"], signal.SIGKILL)
                killed.add(e["pid"])
        wait_for(lambda evs: of(evs, "sm_gone") or
                 {e["pid"] for e in of(evs, "spawn", role="state_manager",
                                       local_rank=local_rank)} - killed, "a state manager")
    return killed


def inplace_cmd(ev, *args: str) -> list[str]:
    """leto-run, 2 ranks in place, survivors replaced: the scripts that speak the protocol
    without the runtime cannot demote themselves in process (test_demotion.py: `release`)."""
    return leto_cmd("--no-status", "--standalone", "--nproc-per-node", "2", "--demote",
                    "replace", "--events", str(ev), *args)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def with_env(needle: str) -> list[int]:
    """Live processes (this one aside) whose environment at exec holds `needle`, e.g.
    ``OUT_DIR=...``: every process of a job inherits it (workers, their grandchildren, state
    managers, the guardian, the fork server)."""
    want = b"\0" + needle.encode() + b"\0"
    found = []
    for e in os.scandir("/proc"):
        if e.name.isdigit() and int(e.name) != os.getpid():
            try:
                with open(f"/proc/{e.name}/environ", "rb") as f:
                    if want in b"\0" + f.read() + b"\0" and pid_alive(int(e.name)):
                        found.append(int(e.name))
            except OSError:
                pass
    return found


def step_losses(d: Path, rank: int) -> dict[int, set]:
    """examples/gpt_inplace.py or byo_train.py --out D: every loss a rank logged, per step
    (float.hex strings; a redone step appears with each value it produced), with the step's
    learning rates where the script logs them (byo_train: `(loss, (lr of each group, ...))`)."""
    out: dict[int, set] = {}
    for line in (d / f"loss_{rank}.jsonl").read_text().splitlines():
        e = json.loads(line)
        out.setdefault(e["step"], set()).add((e["loss"], tuple(e["lrs"])) if "lrs" in e
                                             else e["loss"])
    return out


_RDZV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


def plain_env(monkeypatch, **env: str) -> None:
    """This test process becomes a trainer outside any launcher (plain mode): no LETO_* variable
    but the kernel cache's (LETO_EXT_DIR: the kernels the session built), no torchrun
    rendezvous variables, no job left from another test; then `env` on top."""
    from leto_runtime import runtime
    for k in list(os.environ):
        if (k.startswith("LETO_") and k != "LETO_EXT_DIR") or k in _RDZV:
            monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    runtime.current().forget_job()


def plain_job(monkeypatch, *, rmu: bool = False, device: str = "cpu", **env: str):
    """`leto_runtime.init(seed=3)` in plain mode (`plain_env`); `rmu`: RMU over local memory
    (LETO_PLAIN_RMU=1) instead of stock torch.  The caller forgets the job afterwards."""
    import leto_runtime.job as J
    plain_env(monkeypatch, **({"LETO_PLAIN_RMU": "1"} if rmu else {}), **env)
    return J.init(seed=3, device=device)


def compare_runs(ref: Path, out: Path, world: int, steps, why: str) -> None:
    """Every step of every rank of `out` (redone ones included) logged the reference's loss (and
    lrs) bit for bit, no step is missing, and each rank's final state digest is the reference's."""
    for rank in range(world):
        want, got = step_losses(ref, rank), step_losses(out, rank)
        assert sorted(got) == list(steps), f"rank {rank} missed steps; {why}"
        for step, values in got.items():
            assert values == want[step], f"rank {rank} step {step}: {values} != {want[step]}; {why}"
        assert final_digest(ref, rank) == final_digest(out, rank), \
            f"rank {rank}: final model/optimizer state differs; {why}"


def final_digest(d: Path, rank: int) -> str:
    """sha256 of a rank's final parameters and AdamW moments (examples/gpt_inplace.py --out D)."""
    return json.loads((d / f"final_{rank}.json").read_text())["digest"]


def adamw_oracle(init, cfg):
    """torch.optim.AdamW(foreach=False, fused=False) over copies of `init` (the oracle RMU's
    AdamW is held to bit for bit), plus fresh copies P and zero moments M, V for the code under
    test: (params, oracle, P, M, V)."""
    import torch

    params = [torch.nn.Parameter(x.clone()) for x in init]
    oracle = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                               weight_decay=cfg.weight_decay, foreach=False, fused=False)
    P = [x.clone() for x in init]
    M = [torch.zeros_like(x) for x in init]
    V = [torch.zeros_like(x) for x in init]
    return params, oracle, P, M, V
