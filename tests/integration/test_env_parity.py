"""The worker environment under leto-run equals torchrun's, key by key.

Both launchers run the same env-dumping script with the same options; only documented
differences may differ: LETO_* keys (added), and the values of run ids, ports and paths.
"""
import json

import pytest

from leto_testing import SCRIPTS, base_env, leto_cmd, run, torchrun_cmd

# Values that are per-run by nature (ids, free ports, temp paths) — docs/COMPATIBILITY.md and README documented.
VALUE_MAY_DIFFER = {"TORCHELASTIC_RUN_ID", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE",
                    "OUT_DIR"}  # the last one is this test's own output folder


@pytest.mark.parametrize("opts", [
    ["--nproc-per-node", "2", "--max-restarts", "1"],
    ["--nproc_per_node=3", "--role", "trainer", "--signals-to-handle", "SIGTERM,SIGUSR1"],
])
def test_worker_env_matches_torchrun(tmp_path, opts):
    envs = {}
    for name, cmd in (("torchrun", torchrun_cmd), ("leto", leto_cmd)):
        out = tmp_path / name
        out.mkdir()
        extra = ["--no-status"] if name == "leto" else []
        r = run(cmd(*extra, *opts, str(SCRIPTS / "envdump.py")), base_env(out))
        assert r.returncode == 0, r.stderr[-3000:]
        envs[name] = {p.name: json.loads(p.read_text()) for p in out.glob("env_*.json")}
    assert sorted(envs["torchrun"]) == sorted(envs["leto"])
    for rank_file, t_env in envs["torchrun"].items():
        l_env = envs["leto"][rank_file]
        leto_only = {k for k in l_env if k not in t_env}
        assert all(k.startswith("LETO_") for k in leto_only), leto_only
        missing = {k for k in t_env if k not in l_env}
        assert not missing, f"keys torchrun sets that leto-run does not: {missing}"
        for k, v in t_env.items():
            if k in VALUE_MAY_DIFFER:
                assert l_env[k], k
                continue
            assert l_env[k] == v, f"{rank_file}: {k}: torchrun={v!r} leto={l_env[k]!r}"
        assert l_env["LETO_ROLE"] == "active" and l_env["LETO_GENERATION"] == "0"
