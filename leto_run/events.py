"""JSONL event log: one line per thing that happened, the data later benchmarks and recovery
reports read.

Every record carries ``mono`` (CLOCK_MONOTONIC seconds, comparable across processes of one
machine), ``wall`` (Unix time), ``event``, ``generation``, and where it applies ``rank``,
``local_rank`` and ``role``.  Event names: ``job_start``, ``rendezvous``, ``spawn``, ``exit``,
``failure_detected``, ``hang_detected``, ``stack_dump``, ``inject``, ``stop``, ``restart``,
``signal``, ``job_end``; in-place recovery (`leto_run.inplace`): ``inplace``, ``shadow_ready``,
``hof``, ``demote``, ``promote``, ``promoted``, ``phase``, ``inplace_done``, ``shadow_exit``,
``shadow_respawn``, ``inplace_fallback``.

Contract: only the agent's main thread writes; each line is flushed as it is written, so a
crashed agent leaves a readable log up to its last event.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any


class EventLog:
    def __init__(self, path: str | None, node: str):
        self.path = path
        self.node = node
        self._f = None
        self.records: list[dict[str, Any]] = []   # kept in memory for the end-of-run summary
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._f = open(path, "a", buffering=1, encoding="utf-8")

    def emit(self, event: str, generation: int, *, rank: int | None = None,
             local_rank: int | None = None, role: str | None = None,
             mono: float | None = None, **fields: Any) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "event": event,
            "mono": time.monotonic() if mono is None else mono,
            "wall": time.time(),
            "node": self.node,
            "generation": generation,
        }
        if rank is not None:
            rec["rank"] = rank
        if local_rank is not None:
            rec["local_rank"] = local_rank
        if role is not None:
            rec["role"] = role
        rec.update(fields)
        self.records.append(rec)
        if self._f:
            self._f.write(json.dumps(rec, default=str) + "\n")
        return rec

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None


def read_events(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
