"""Two `leto-run --nnodes 2` agents on 127.0.0.1 meet through the c10d rendezvous (TCPStore),
run a gloo all-reduce job to completion, and a rank failure on one node restarts the group on
both nodes (restart mode: `--recovery restart`, which several nodes run without a shared
secret, as torchrun does)."""
import subprocess

from leto_testing import ROOT, SCRIPTS, base_env, events, free_port, leto_cmd


def start_agents(tmp_path, out_dir, *extra):
    port = free_port()
    procs = []
    for node in range(2):
        ev = tmp_path / f"ev{node}.jsonl"
        cmd = leto_cmd("--no-status", "--nnodes", "2", "--nproc-per-node", "2",
                       "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                       "--rdzv-id", "mn-test", "--recovery", "restart", "--events", str(ev),
                       *extra,
                       str(SCRIPTS / "allreduce.py"), "--steps", "6")
        procs.append(subprocess.Popen(cmd, env=base_env(out_dir), cwd=str(ROOT), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=150))
    finally:
        for p in procs:
            p.kill()
    return procs, outs


def expected_total(world: int, steps: int = 6) -> float:
    return float(sum(sum(r + 1 + s for r in range(world)) for s in range(steps)))


def test_two_agents_complete_allreduce(tmp_path, out_dir):
    procs, outs = start_agents(tmp_path, out_dir)
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    world, total, attempt = (out_dir / "result").read_text().split()
    assert (world, attempt) == ("4", "0")
    assert float(total) == expected_total(4)
    ranks = sorted(e["rank"] for n in (0, 1) for e in events(tmp_path / f"ev{n}.jsonl")
                   if e["event"] == "spawn" and e["role"] == "active")
    assert ranks == [0, 1, 2, 3]


def test_failure_on_one_node_restarts_both(tmp_path, out_dir):
    procs, outs = start_agents(tmp_path, out_dir, "--max-restarts", "1",
                               "--inject", "kill:rank=3:step=2")
    assert [p.returncode for p in procs] == [0, 0], [o[1][-3000:] for o in outs]
    world, total, attempt = (out_dir / "result").read_text().split()
    # torchrun semantics: restart counts are per node, and a node that restarts because a peer
    # re-joined the rendezvous (rather than because its own worker failed) does not count it.
    assert world == "4" and attempt in ("0", "1")
    assert float(total) == expected_total(4)
    counted = [sum(e["event"] == "restart" and e.get("restart_count", 0) > 0
                   for e in events(tmp_path / f"ev{n}.jsonl")) for n in (0, 1)]
    assert counted[1] == 1          # node 1 owns the failed rank 3: its restart counts
    for n in (0, 1):
        evs = events(tmp_path / f"ev{n}.jsonl")
        assert sum(e["event"] == "rendezvous" for e in evs) == 2, n
        assert {e["generation"] for e in evs
                if e["event"] == "spawn" and e["role"] == "active"} == {0, 1}
