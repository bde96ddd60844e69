"""Where the agent's TCPStore servers listen: loopback for a single-node job, the rendezvous
interface for several nodes -- never every interface (torch's TCPStore binds the wildcard).

Role: `bind_plan` decides (pure: host, its resolved addresses, single node or not -> the
addresses to try, the address clients are told, and why); `server_store` binds a socket
accordingly and hands it to a TCPStore server (`master_listen_fd`, which the libuv backend
adopts and closes when the server goes).

Calling contract: `server_store` raises `StoreBindError` (with the fix) when no planned address
can be bound, and passes an `OSError` of EADDRINUSE through (the c10d rendezvous then joins as a
client, as torch does); every TCPStore operation is bounded by `timeout`.
"""
from __future__ import annotations

import datetime
import errno
import ipaddress
import os
import socket
from dataclasses import dataclass

from torch.distributed import TCPStore

LOOPBACK_V4 = "127.0.0.1"
LISTEN_BACKLOG = 4096            # the same as the libuv backend's own listen()


class StoreBindError(OSError):
    """No planned address could be bound (message names the host and the fix)."""


@dataclass(frozen=True)
class BindPlan:
    addresses: tuple[str, ...]   # IP literals to try, in order
    advertise: str               # what clients connect to (MASTER_ADDR for the worker store)
    reason: str


def _is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip.split("%")[0]).is_loopback
    except ValueError:
        return False


def resolve(host: str) -> tuple[str, ...]:
    """`host`'s TCP addresses, IPv4 first, each once ("" when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return ()
    seen: list[str] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        for fam, _, _, _, sa in infos:
            if fam == family and sa[0] not in seen:
                seen.append(sa[0])
    return tuple(seen)


def bind_plan(host: str, resolved: tuple[str, ...], single_node: bool) -> BindPlan:
    """Single node: loopback only.  `host` keeps being what clients use when it names exactly
    one address and that is a loopback one (torchrun's MASTER_ADDR stays as it is); otherwise
    clients are told 127.0.0.1.  Several nodes: the addresses `host` resolves to, which the
    other nodes use to reach it (the rendezvous interface)."""
    if single_node:
        if len(resolved) == 1 and _is_loopback(resolved[0]):
            return BindPlan(resolved, host, f"single node: {host} is loopback")
        return BindPlan((LOOPBACK_V4,), LOOPBACK_V4,
                        f"single node: {host} resolves to {list(resolved) or 'nothing'}, not "
                        "one loopback address; clients use 127.0.0.1")
    routable = tuple(ip for ip in resolved if not _is_loopback(ip))
    if routable:
        return BindPlan(routable, host, f"several nodes: the addresses of {host}")
    if host == "localhost" or (resolved and _is_loopback(host)):
        # named loopback on purpose: several agents of one machine (tests, one-host trials)
        return BindPlan(resolved, host, f"several nodes on this machine: {host} is loopback")
    # e.g. Debian's /etc/hosts maps the host name to 127.0.1.1: other nodes could not connect
    raise StoreBindError(
        errno.EADDRNOTAVAIL,
        f"{host!r} resolves only to loopback ({', '.join(resolved) or 'nothing'}): the other "
        "nodes could not reach a store listening there -- fix: give this node's address on the "
        "network the other nodes use with --local-addr (or --rdzv-endpoint / --master-addr)")


def listen_socket(plan: BindPlan, port: int, host: str) -> socket.socket:
    """A listening socket on the first address of `plan` that this machine has."""
    errors = []
    for ip in plan.addresses:
        fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
        s = socket.socket(fam, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as c10d does
            s.bind((ip, port))
            s.listen(LISTEN_BACKLOG)
            return s
        except OSError as e:
            s.close()
            if e.errno == errno.EADDRINUSE:
                raise
            errors.append(f"{ip}: {e.strerror or e}")
    raise StoreBindError(
        errno.EADDRNOTAVAIL,
        f"cannot listen on {host!r} (port {port}): {'; '.join(errors) or 'it does not resolve'}"
        " -- fix: give this node's address on the network the other nodes use with "
        "--local-addr (or --rdzv-endpoint / --master-addr naming this node)")


def server_store(host: str, port: int, *, single_node: bool, timeout: float,
                 world_size: int | None = None, wait_for_workers: bool = False,
                 resolved: tuple[str, ...] | None = None) -> tuple[TCPStore, BindPlan]:
    """A TCPStore server listening where `bind_plan` says.  Returns (store, plan)."""
    plan = bind_plan(host, resolve(host) if resolved is None else resolved, single_node)
    sock = listen_socket(plan, port, host)
    ip, bound = sock.getsockname()[:2]
    inode = os.fstat(sock.fileno()).st_ino
    fd = sock.detach()           # the server owns the descriptor from here (libuv closes it)
    try:
        # The server's own client connects to the address it listens on, whatever `host` is.
        store = TCPStore(ip, bound, world_size, True,
                         datetime.timedelta(seconds=timeout), wait_for_workers=wait_for_workers,
                         master_listen_fd=fd)
    except BaseException:
        _close_if_ours(fd, inode)
        raise
    return store, plan


def _close_if_ours(fd: int, inode: int) -> None:
    """A failed server may or may not have closed the descriptor it adopted: close it only if
    the number still names our socket (never a descriptor opened since under that number)."""
    try:
        if os.fstat(fd).st_ino == inode:
            os.close(fd)
    except OSError:
        pass


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(ip, port) of every TCP socket `pid` listens on (from /proc; for tests and status)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            with open(f"/proc/{pid}/net/{name}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] != "0A" or cols[9] not in inodes:      # 0A: LISTEN
                continue
            hexip, hexport = cols[1].split(":")
            out.append((_proc_ip(hexip, v6), int(hexport, 16)))
    return out


def _proc_ip(hexip: str, v6: bool) -> str:
    raw = bytes.fromhex(hexip)
    # /proc/net/tcp{,6} print each 32-bit word in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.IPv6Address(words) if v6 else ipaddress.IPv4Address(words))
