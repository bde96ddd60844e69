"""`--print-config`: the resolved job configuration as a YAML job file that `--config` accepts.

Role: turn a `JobConfig` back into the input schema, so that

    leto-run ... --print-config > job.yaml && leto-run --config job.yaml

runs the same job (same rendezvous id included).  Fields the loader derives are left out
(`min_nodes`/`max_nodes` from nnodes, `auto_c10d`), the loader's warnings become comments, and
the rendezvous is written in the form whose resolution gives the printed result again:
torchrun's single-node rule (static, no endpoint, no master port -> c10d on localhost:0) and
`--standalone` keep their inputs, not the endpoint they produce.

Calling contract: `render(cfg) -> str` is pure; `input_dict(cfg)` is the mapping it dumps.
"""
from __future__ import annotations

import yaml

from leto_run import config as C
from leto_run.config_load import DERIVED

HEADER = ("# leto-run resolved configuration; feed it back with --config FILE "
          "(derived fields left out)")


def input_dict(cfg: C.JobConfig) -> dict:
    """`cfg.to_dict()` without derived keys and warnings, rendezvous in its input form."""
    out = cfg.to_dict()
    out.pop("warnings", None)
    for key in DERIVED:
        sec, name = key.split(".")
        out[sec].pop(name, None)
    rz = out["rendezvous"]
    if cfg.rendezvous.standalone:
        # --standalone chooses c10d on a free local port itself; an endpoint contradicts it
        rz.update(backend="static", endpoint="")
    elif cfg.rendezvous.auto_c10d:
        rz.update(backend="static", endpoint="", master_port=None)
    if rz["backend"] == "static" or cfg.rendezvous.auto_c10d or cfg.rendezvous.standalone:
        # the static backend adds rank=node_rank itself (and checks a given one against it)
        rz["conf"] = {k: v for k, v in rz["conf"].items() if k != "rank"}
    return out


def render(cfg: C.JobConfig) -> str:
    rz = cfg.rendezvous
    notes = "".join(f"# warning: {w}\n" for w in cfg.warnings)
    if rz.standalone or rz.auto_c10d:
        why = "--standalone" if rz.standalone else "torchrun's single-node rule"
        notes += f"# resolves to: {rz.backend} rendezvous on {rz.endpoint} ({why})\n"
    return f"{HEADER}\n{notes}" + yaml.safe_dump(input_dict(cfg), sort_keys=False)
