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

Contract: `next_round` blocks for at most the rendezvous' own join timeout; it raises
`RendezvousFailed` with the cause on timeout or a closed rendezvous.
"""
from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Any

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from leto_run.config import JobConfig
from leto_run.errors import RendezvousFailed
from leto_run.worker_env import WorkerIdentity


def make_handler(cfg: JobConfig) -> tuple[RendezvousHandler, str | None, int | None]:
    """Return (handler, master_addr override, master_port override) like torchrun."""
    rz, la = cfg.rendezvous, cfg.launch
    conf: dict[str, Any] = dict(rz.conf)
    endpoint = rz.endpoint
    if rz.backend == "static":
        conf["rank"] = int(conf.get("rank", la.node_rank))
        if not endpoint:
            endpoint = f"{rz.master_addr}:{rz.master_port if rz.master_port is not None else 29500}"
    params = RendezvousParameters(backend=rz.backend, endpoint=endpoint, run_id=rz.id,
                                  min_nodes=la.min_nodes, max_nodes=la.max_nodes,
                                  local_addr=rz.local_addr, **conf)
    master_addr = master_port = None
    if rz.backend == "static":
        master_addr, master_port = parse_rendezvous_endpoint(endpoint, default_port=-1)
    try:
        handler = rdzv_registry.get_rendezvous_handler(params)
    except Exception as e:  # torch raises ValueError/RuntimeError/RendezvousError variants
        raise RendezvousFailed(f"cannot set up the {rz.backend} rendezvous at "
                               f"'{endpoint}': {e}") from e
    return handler, master_addr, master_port


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


def next_round(handler: RendezvousHandler, *, round_no: int, restart_count: int, role: str,
               local_world_size: int, master_addr: str | None, master_port: int | None,
               store_timeout: float = 900.0) -> RoundResult:
    try:
        info = handler.next_rendezvous()
    except Exception as e:
        detail = str(e).strip() or (
            "not enough nodes joined in time; check that every node uses the same "
            "--rdzv-endpoint and --rdzv-id, or raise --rdzv-conf join_timeout=SECONDS")
        raise RendezvousFailed(f"rendezvous round {round_no} failed: {type(e).__name__}: "
                               f"{detail}") from e
    store = info.store
    group_rank, group_world_size = info.rank, info.world_size
    addr = master_addr or info.bootstrap_store_info.master_addr
    port = master_port or info.bootstrap_store_info.master_port
    ids = assign_ranks(store, round_no=round_no, group_rank=group_rank,
                       group_world_size=group_world_size, role=role,
                       local_world_size=local_world_size)
    # The dynamic backends scope `store` to the round, so one key name is right for every node
    # (their restart counts may differ: a membership restart does not count).  The static store
    # is not scoped; there every node restarts on every failure, so the count agrees.
    key = "leto/worker_store" + ("" if handler.get_backend() != "static" else f"/{restart_count}")
    server = None
    if group_rank == 0:
        server = TCPStore(host_name=addr, port=0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=store_timeout))
        store.set(key, f"{server.port}".encode())
    port = int(store.get(key).decode())
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
