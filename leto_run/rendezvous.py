"""Rendezvous through torch.distributed.elastic, and worker rank assignment.

We compose with torch's rendezvous handlers (c10d with its TCPStore, static, etcd) rather than
re-implementing them: `make_handler` builds the handler exactly as torchrun's `launch_agent`
does, `next_round` runs one round and assigns global/role ranks with torchrun's algorithm.

Why our own rank assignment: torch's lives on a private agent method.  The keys go into the
store the round returned, which torch's dynamic (c10d/etcd) rendezvous already scopes to the
round, so a later round never reads a stale assignment (torchrun issue #135712).

Workers get a **fresh TCPStore per round** (hosted by the group-rank-0 agent on a free port)
as their MASTER_ADDR/MASTER_PORT.  torch's agent hands them the rendezvous' shared store, which
outlives restarts: after a restart, gloo then reads the dead workers' addresses from stale keys
and fails with "Connection refused" (reproduced with torchrun 2.13; issue #135712).

Where the stores listen (`leto_run.store_listen`): a single-node job's on loopback only, a
multi-node job's on the rendezvous interface (the address the other nodes use), never on every
interface as torch's TCPStore does.  For that we build the static and c10d handlers' stores
ourselves (`_StaticRendezvous`, `_c10d_handler`; torch's logic otherwise: which node hosts,
timeouts, a second agent of a machine joining as a client).  The etcd backends and a c10d
`store_type=file` are torch's, unchanged.

With the job's key (`leto_run.job_secret`), the rendezvous store is an `AuthStore`: torch's
rendezvous state (a pickle it loads), the rank assignment and the worker store's port carry
the job's MAC, so a process without the key can neither inject a rendezvous state nor redirect
the workers; one that tried is `errors.ControlForged`.

Contract: `next_round` blocks for at most the rendezvous' own join timeout; it raises
`RendezvousFailed` with the cause on timeout, a closed rendezvous or a store that cannot listen
where it must, and `ControlForged` for a rendezvous value that does not verify.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
from dataclasses import dataclass
from typing import Any

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import (RendezvousHandler, RendezvousInfo,
                                                  RendezvousParameters, RendezvousStoreInfo)
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
    DEFAULT_PORT as C10D_DEFAULT_PORT, C10dRendezvousBackend)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
from torch.distributed.elastic.rendezvous.utils import (_matches_machine_hostname,
                                                        parse_rendezvous_endpoint)

from leto_run import job_secret
from leto_run.config import JobConfig
from leto_run.errors import RendezvousFailed
from leto_run.store_listen import StoreBindError, server_store
from leto_run.worker_env import WorkerIdentity
from leto_runtime.auth_store import AuthStore
from leto_runtime.wire import contract as C
from leto_runtime.control_auth import ForgedControlKey

STATIC_TIMEOUT_S = 600           # torch's static rendezvous default (`--rdzv-conf timeout=`)
C10D_READ_TIMEOUT_S = 60         # torch's c10d store default (`--rdzv-conf read_timeout=`)


def make_handler(cfg: JobConfig, key: bytes | None = None
                 ) -> tuple[RendezvousHandler, str | None, int | None]:
    """Return (handler, master_addr override, master_port override) like torchrun; `key`: the
    job's (`job_secret.job_key`), None for an unauthenticated rendezvous store."""
    rz, la = cfg.rendezvous, cfg.launch
    single = la.max_nodes <= 1
    conf: dict[str, Any] = dict(rz.conf)
    endpoint = rz.endpoint
    if rz.backend == "static":
        conf["rank"] = int(conf.get("rank", la.node_rank))
        if not endpoint:
            endpoint = f"{rz.master_addr}:{rz.master_port if rz.master_port is not None else 29500}"
    # torch shares one store with torchrun's workers (`use_agent_store`) and publishes its
    # address in a node's first round only, so a replacement node joining a later round would
    # wait for it forever.  Leto's workers get their own store per round (next_round): sharing
    # off, through torch's own opt-out, which its handlers read at every round.  The agent's
    # setting, not the workers' (`worker_env` leaves it out of their environment).
    os.environ[C.TORCH_SHARE_RDZV_STORE_OFF] = "1"
    params = RendezvousParameters(backend=rz.backend, endpoint=endpoint, run_id=rz.id,
                                  min_nodes=la.min_nodes, max_nodes=la.max_nodes,
                                  local_addr=rz.local_addr, **conf)
    master_addr = master_port = None
    if rz.backend == "static":
        master_addr, master_port = parse_rendezvous_endpoint(endpoint, default_port=-1)
    try:
        if rz.backend == "static":
            handler = _static_handler(params, key, single)
        elif rz.backend == "c10d" and params.get("store_type", "tcp").strip().lower() == "tcp":
            handler = _c10d_handler(params, key, single)
        else:
            handler = rdzv_registry.get_rendezvous_handler(params)
    except ForgedControlKey as e:
        raise job_secret.forged("the rendezvous", e.key, e.reason, not single) from e
    except Exception as e:  # torch raises ValueError/RuntimeError/RendezvousError variants
        raise RendezvousFailed(f"cannot set up the {rz.backend} rendezvous at "
                               f"'{endpoint}': {e}") from e
    return handler, master_addr, master_port


class _StaticRendezvous(StaticTCPRendezvous):
    """torch's static rendezvous, its store listening where `store_listen` says and signed with
    the job's key when there is one."""

    def __init__(self, *args, key: bytes | None, single_node: bool):
        super().__init__(*args)
        self._key, self._single = key, single_node

    def next_rendezvous(self) -> RendezvousInfo:
        if not self._store:
            if self.rank == 0:
                self._store, _ = server_store(
                    self.master_addr, self.master_port, single_node=self._single,
                    timeout=self.timeout.total_seconds(), world_size=self.world_size,
                    wait_for_workers=True)
            else:
                self._store = TCPStore(self.master_addr, self.master_port, self.world_size,
                                       False, self.timeout)
        store = PrefixStore(self.run_id, self._store)
        if self._key is not None:
            store = AuthStore(store, self._key)
        return RendezvousInfo(store, self.rank, self.world_size,
                              RendezvousStoreInfo(self.master_addr, self.master_port))


def _static_handler(params: RendezvousParameters, key: bytes | None,
                    single: bool) -> RendezvousHandler:
    """torch's `create_rdzv_handler` for the static backend, with our store."""
    addr, port = parse_rendezvous_endpoint(params.endpoint.strip(), -1)
    if port == -1:
        raise ValueError(f"Port is absent in endpoint: {params.endpoint}")
    timeout = int(params.config.get("timeout", STATIC_TIMEOUT_S))
    return _StaticRendezvous(addr, port, int(params.config["rank"]), params.max_nodes,
                             params.run_id, timeout, key=key, single_node=single)


def _c10d_handler(params: RendezvousParameters, key: bytes | None,
                  single: bool) -> RendezvousHandler:
    """torch's c10d handler (`create_backend` + `create_handler`) over our store."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=C10D_DEFAULT_PORT)
    timeout = params.get_as_int("read_timeout", C10D_READ_TIMEOUT_S)
    if timeout is None or timeout <= 0:
        raise ValueError("The read timeout must be a positive integer.")
    explicit = params.get_as_bool("is_host")
    is_host = explicit if explicit is not None else _matches_machine_hostname(host)
    store = None
    if is_host:
        try:
            store, _ = server_store(host, port, single_node=single, timeout=timeout)
        except OSError as e:
            # torch's rule: another agent of this machine hosts it already; join as a client.
            if explicit is not None or e.errno != errno.EADDRINUSE:
                raise
    if store is None:
        store = TCPStore(host, port, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout))
    base = store if key is None else AuthStore(store, key)
    return create_handler(base, C10dRendezvousBackend(base, params.run_id), params)


@dataclass(frozen=True)
class RoundResult:
    round_no: int
    store: Any
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    identities: tuple[WorkerIdentity, ...]
    use_agent_store: bool
    worker_store_server: Any = None     # keep a reference: the server lives as long as it does


@contextlib.contextmanager
def _no_skew(single_node: bool):
    """torch's dynamic rendezvous sleeps 0-300 ms before its first round, to skew the joins of
    several nodes apart; a one-node job has no other node, and would pay it at every start
    (docs/BENCHMARKS.md, "Launcher overhead").  For that round only, a one-node job's handler
    gets a `_delay` that skips the random skew (a range) and keeps every other delay (the
    one-second polls); without that private function (another torch) nothing changes."""
    orig = getattr(dynamic_rendezvous, "_delay", None)
    if not single_node or orig is None:
        yield
        return

    def delay(seconds):
        if not isinstance(seconds, tuple):
            orig(seconds)

    dynamic_rendezvous._delay = delay
    try:
        yield
    finally:
        dynamic_rendezvous._delay = orig


def next_round(handler: RendezvousHandler, *, round_no: int, restart_count: int, role: str,
               local_world_size: int, master_addr: str | None, master_port: int | None,
               store_timeout: float = 900.0, single_node: bool = False) -> RoundResult:
    """One round; `single_node` (max nodes 1): the worker store listens on loopback only, and
    the first round skips torch's skew of several nodes' joins (`_no_skew`)."""
    try:
        with _no_skew(single_node):
            info = handler.next_rendezvous()
    except ForgedControlKey as e:
        raise job_secret.forged("the rendezvous", e.key, e.reason, not single_node) from e
    except Exception as e:
        detail = str(e).strip() or (
            "not enough nodes joined in time; check that every node uses the same "
            "--rdzv-endpoint and --rdzv-id, or raise --rdzv-conf join_timeout=SECONDS")
        raise RendezvousFailed(f"rendezvous round {round_no} failed: {type(e).__name__}: "
                               f"{detail}") from e
    store = info.store
    group_rank, group_world_size = info.rank, info.world_size
    addr = master_addr or info.bootstrap_store_info.master_addr
    # The dynamic backends scope `store` to the round, so one key name is right for every node
    # (their restart counts may differ: a membership restart does not count).  The static store
    # is not scoped; there every node restarts on every failure, so the count agrees.
    key = "leto/worker_store" + ("" if handler.get_backend() != "static" else f"/{restart_count}")
    server = None
    try:
        ids = assign_ranks(store, round_no=round_no, group_rank=group_rank,
                           group_world_size=group_world_size, role=role,
                           local_world_size=local_world_size)
        if group_rank == 0:
            server, plan = server_store(addr, 0, single_node=single_node, timeout=store_timeout)
            addr = plan.advertise
            store.set(key, f"{server.port}".encode())
        port = int(store.get(key).decode())
    except ForgedControlKey as e:
        raise job_secret.forged("the rendezvous", e.key, e.reason, not single_node) from e
    except StoreBindError as e:
        raise RendezvousFailed(f"the worker store of round {round_no}: {e}") from e
    return RoundResult(round_no, store, group_rank, group_world_size, addr, port, ids,
                       True, server)


def assign_ranks(store, *, round_no: int, group_rank: int, group_world_size: int, role: str,
                 local_world_size: int) -> tuple[WorkerIdentity, ...]:
    """torchrun's assignment: global ranks by group rank, role ranks within each role."""
    prefix = "leto/ranks/"
    store.set(f"{prefix}role_info/{group_rank}",
              json.dumps([role, group_rank, local_world_size]).encode())
    if group_rank == 0:
        infos = [json.loads(b) for b in store.multi_get(
            [f"{prefix}role_info/{i}" for i in range(group_world_size)])]
        role_sizes: dict[str, int] = {}
        for r, _, n in infos:
            role_sizes[r] = role_sizes.get(r, 0) + n
        global_size = sum(n for _, _, n in infos)
        base_global, role_next = 0, dict.fromkeys(role_sizes, 0)
        keys, values = [], []
        for i, (r, _, n) in enumerate(infos):
            keys.append(f"{prefix}assigned/{i}")
            values.append(json.dumps([base_global, global_size, role_next[r], role_sizes[r]]).encode())
            base_global += n
            role_next[r] += n
        store.multi_set(keys, values)
    base_global, world, base_role, role_world = json.loads(store.get(f"{prefix}assigned/{group_rank}"))
    return tuple(
        WorkerIdentity(local_rank=lr, global_rank=base_global + lr, role_rank=base_role + lr,
                       world_size=world, role_world_size=role_world,
                       local_world_size=local_world_size, group_rank=group_rank,
                       group_world_size=group_world_size, role_name=role)
        for lr in range(local_world_size))
