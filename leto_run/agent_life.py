"""What the agent acquires and must give back, and the one wait that is not its selector's.

`release(agent)` frees everything the agent holds -- the checkpoint-directory lock, the
guardian, the run directory, the heartbeat socket, the rendezvous store -- and tolerates an
agent built only in part: `Agent.__init__` calls it when a step of its construction fails
(`run_job` never gets an agent to close then), `Agent.close` at the end of every job.

`interruptible(fn, sig_fd, on_signals)`: torch's rendezvous blocks in C++ (a TCPStore
join, a static store waiting for its workers: up to its timeout, 600 s by default) where no
Python signal handler runs, so the agent's signal wakeup fd would go unread.  The blocking
call runs in a daemon thread; the main thread waits on the wakeup fd and the call's
completion, and a SIGINT/SIGTERM raises `StoppedBySignal` out of the wait at once.  The thread
is abandoned: it holds nothing of the agent's but the handler, which `release` shuts down, and
it dies with the process.
"""
from __future__ import annotations

import os
import selectors
import shutil
import signal
import threading
from typing import Any, Callable

POLL_S = 0.25        # bounds each wait on the selector (a lost wakeup costs at most this)
ABANDONED: list[threading.Thread] = []   # waits a signal ended while their call ran on
SHUTDOWN_WAIT_S = 5.0    # the rendezvous' shutdown (closing the round for the other nodes)
PROBE_JOIN_S = 2.0       # the membership probe's way out of the handler (one store call)


def interruptible(fn: Callable[[], Any], sig_fd: int, on_signals: Callable[[], None]) -> Any:
    """Run `fn()` in a daemon thread; return its result or raise its exception.  While it
    runs, signals arriving on `sig_fd` go to `on_signals`, which raises to stop the wait."""
    done = threading.Event()
    box: dict[str, Any] = {}
    r, w = os.pipe()

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:        # handed to the main thread, raised there
            box["error"] = e
        done.set()
        try:
            os.write(w, b"x")
        except OSError:
            pass                          # the main thread gave up already

    wait = selectors.DefaultSelector()
    try:
        wait.register(sig_fd, selectors.EVENT_READ, "sig")
        wait.register(r, selectors.EVENT_READ, "done")
        thread = threading.Thread(target=call, name="leto-store-wait", daemon=True)
        thread.start()
        ABANDONED.append(thread)          # until it is done: see `release`
        while not done.is_set():
            for key, _ in wait.select(timeout=POLL_S):
                if key.data == "sig":
                    on_signals()          # raises StoppedBySignal for SIGINT/SIGTERM
    finally:
        if done.is_set():
            ABANDONED.remove(thread)
        wait.close()
        os.close(r)
        if done.is_set():
            os.close(w)
        # else: the thread still owns `w`; it is a few bytes, closed with the process
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _bounded(fn: Callable[[], Any], timeout: float) -> None:
    """`fn()` in a daemon thread, waited for at most `timeout` s (then abandoned)."""
    t = threading.Thread(target=fn, name="leto-bounded", daemon=True)
    t.start()
    t.join(timeout)


def _shutdown(handler: Any, probe: Any) -> None:
    """The rendezvous' shutdown, unless the round's membership probe is still inside the
    handler (stuck in a store call): torch's shutdown syncs the same rendezvous state without
    the lock `num_nodes_waiting` takes."""
    if probe is not None and probe.thread.is_alive():
        return
    _bounded(handler.shutdown, SHUTDOWN_WAIT_S)


def release(a: Any) -> None:
    """Free what agent `a` holds; every attribute may be missing (a construction that failed
    part way).  Each step runs even when an earlier one failed."""
    if getattr(a, "_closed", False):
        return
    a._closed = True
    steps: list[Callable[[], Any]] = []

    def part(name: str, method: str, *args: Any) -> None:
        obj = getattr(a, name, None)
        if obj is not None:
            steps.append(lambda: getattr(obj, method)(*args))

    part("status", "stop")
    part("pump", "close")
    part("hb", "close")
    part("notices", "close")
    part("launcher", "close")
    part("nodes", "close", True)     # its thread off the store before the store goes
    part("membership", "close", PROBE_JOIN_S)    # out of the handler before its shutdown
    handler = getattr(a, "handler", None)
    if handler is not None and not any(t.is_alive() for t in ABANDONED):
        # Not after an abandoned wait: it still holds the store's one connection, and torch's
        # shutdown would queue behind it for its whole timeout (torchrun does not shut the
        # rendezvous down after a signal either: the other nodes may go on).  Bounded anyway.
        steps.append(lambda: _shutdown(handler, getattr(a, "membership", None)))
    steps.append(lambda: signal.set_wakeup_fd(-1))
    part("inplace", "close")
    if getattr(a, "_partial", False):
        part("sms", "stop")          # run() stops them otherwise
    part("guardian", "release")
    part("ckpt_lock", "release")
    part("events", "close")
    run_dir = getattr(a, "run_dir", None)
    if run_dir:
        steps.append(lambda: shutil.rmtree(run_dir, ignore_errors=True))
    console = getattr(a, "console", None)
    if console is not None:
        steps.append(console.settle_stdout)
    for step in steps:
        try:
            step()
        except Exception:     # noqa: BLE001 -- the rest must still be released
            pass


def write_report(log_root: str, report: str) -> None:
    """The recovery report when the console is lost: next to the event log, never raising."""
    try:
        with open(os.path.join(log_root, "report.txt"), "w", encoding="utf-8") as f:
            f.write(report + "\n")
    except OSError:
        pass
