"""Shared test helpers: run real `leto-run` / `torchrun` processes with timeouts.

Imported by tests as `from leto_testing import ...` (tests/ is on sys.path through
tests/conftest.py).  Not named conftest: several conftest modules exist (tests/gpu has one),
and `from conftest import` would pick whichever was imported first."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "integration" / "scripts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=str(ROOT), **kw)


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def step_losses(d: Path, rank: int) -> dict[int, set[str]]:
    """examples/gpt_inplace.py --out D: every loss a rank logged, per step (float.hex strings;
    a redone step appears with each value it produced)."""
    out: dict[int, set[str]] = {}
    for line in (d / f"loss_{rank}.jsonl").read_text().splitlines():
        e = json.loads(line)
        out.setdefault(e["step"], set()).add(e["loss"])
    return out


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
