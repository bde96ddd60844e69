"""`python -m leto_run.state_manager ...`: one rank slot's state manager process.

Start-up: raise RLIMIT_NOFILE -> open the device (CUDA without a context, or the memfd stand-in;
a GPU that cannot serve is reported and the process exits 3) -> connect to the agent's fd keeper
and restore whatever it kept (a restart after a crash gets all memory and metadata back) ->
bind the socket -> tell the keeper "ready" -> serve until SIGTERM/SIGINT.

Exit codes: 0 stopped by signal, 2 bad arguments, 3 the device cannot serve, 4 the keeper's
snapshot cannot be used (e.g. another device kind), 5 the keeper is unreachable.
Log lines on stderr start with ``[leto state-manager slot=S pid=P]``.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

from leto_run.state_manager.keeper import KeeperLink, allow_file_path, sm_socket_path
from leto_run.state_manager.metadata import Geometry, PoolMeta, SnapshotError
from leto_runtime.wire.geometry import device_page_bytes
from leto_run.state_manager.pages import device_owner
from leto_run.state_manager.pool import FD_RESERVE, Pool
from leto_run.state_manager.server import Server
from leto_runtime.wire import bulletin
from leto_runtime.wire import protocol as P

EXIT_ARGS, EXIT_DEVICE, EXIT_SNAPSHOT, EXIT_KEEPER = 2, 3, 4, 5


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m leto_run.state_manager",
                                 description="Leto state manager: the Resilient Memory Pool of one rank slot")
    ap.add_argument("--run-dir", required=True, help="the job's private 0700 directory")
    ap.add_argument("--slot", type=int, default=0, help="local rank slot (also the default GPU)")
    ap.add_argument("--socket", help="socket path (default RUN_DIR/sm<slot>.sock)")
    ap.add_argument("--keeper", help="the agent's fd keeper socket; without it, no crash recovery")
    ap.add_argument("--device", default="auto", help="cpu | cuda:N | auto (default)")
    g = Geometry()
    ap.add_argument("--data-pages", type=int, default=g.data_pages, help="D (default 1024)")
    ap.add_argument("--tier1", type=int, default=g.tier1, help="H1 (default 16)")
    ap.add_argument("--tier2", type=int, default=g.tier2, help="H2 (default 1)")
    ap.add_argument("--page-bytes", type=int, default=g.page_bytes,
                    help="host page size S; device pages are S rounded up to the GPU granularity")
    ap.add_argument("--allow-wait", type=float, default=2.0,
                    help="seconds a connecting pid may wait to be registered by the agent")
    ap.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    tag = f"[leto state-manager slot={a.slot} pid={os.getpid()}]"

    def log(msg: str) -> None:
        sys.stderr.write(f"{tag} {msg}\n")
        sys.stderr.flush()

    geometry = Geometry(a.data_pages, a.tier1, a.tier2, a.page_bytes)
    if geometry.problems():
        log("bad geometry: " + "; ".join(geometry.problems()))
        return EXIT_ARGS
    soft, hard = P.raise_nofile_limit()
    try:
        device = device_owner(a.device, a.slot)
    except P.DeviceUnavailable as e:
        log(f"this GPU cannot serve a memory pool: {e.message}")
        return EXIT_DEVICE
    except ValueError as e:
        log(str(e))
        return EXIT_ARGS
    dpage = device_page_bytes(geometry.page_bytes, device.granularity) \
        if device.kind == "cuda" else geometry.page_bytes

    keeper, kept, snap = None, {}, None
    if a.keeper:
        try:
            keeper = KeeperLink(a.keeper)
            snap, kept = keeper.hello(max_fds=max(0, soft - FD_RESERVE))
        except P.RmpError as e:
            log(f"fd keeper at {a.keeper} unreachable: {e}")
            return EXIT_KEEPER
    try:
        if snap is not None:
            if (snap.get("device") or {}).get("kind") != device.kind:
                raise SnapshotError(f"the kept pool was made on {snap.get('device')}, this "
                                    f"state manager runs on {device.info()}")
            meta = PoolMeta.from_snapshot(snap["meta"])
            if meta.geometry != geometry:
                log(f"keeping the restored geometry {meta.geometry} (arguments said {geometry})")
        else:
            meta = PoolMeta(geometry, dpage)
    except SnapshotError as e:
        P.close_fds(list(kept.values()))
        log(f"cannot restore the kept pool: {e}")
        return EXIT_SNAPSHOT
    sock = a.socket or sm_socket_path(a.run_dir, a.slot)
    try:
        board = bulletin.Writer(bulletin.path_for(sock))
    except OSError as e:     # trainers then ask at every step boundary instead
        log(f"WARNING: no loss bulletin at {bulletin.path_for(sock)} ({e.strerror})")
        board = None
    pool = Pool(meta, device, keeper, log, bulletin=board)
    missing = pool.restore(kept)
    if missing:
        log(f"WARNING: {len(missing)} page(s) had no kept fd; marked failed for reconstruction")

    server = Server(pool, sock,
                    allow_file=allow_file_path(a.run_dir, a.slot),
                    parent_pid=a.parent_pid or os.getppid(), allow_wait=a.allow_wait, log=log)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: server.request_stop())
    if keeper is not None:
        try:
            keeper.ready()
        except P.RmpError as e:
            log(f"WARNING: could not tell the keeper we are ready: {e}")
    log(f"serving {server.path}: device={device.info()} geometry={meta.geometry.to_json()} "
        f"states={len(meta.states)} page_fds={len(pool.fds)} "
        f"{'restored from keeper' if snap is not None else 'fresh'} nofile={soft}/{hard}")
    server.serve()
    log("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
