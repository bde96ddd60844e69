"""In-place recovery across two `leto-run --nnodes 2` agents (c10d rendezvous on 127.0.0.1):
a rank dies on node 1; node 1's agent declares the HOF in the job's store, node 0's agent sees
it there and promotes its own shadows too, and the GPT run stays bit-identical to torchrun.
The agents share the job's secret through one 0600 file (--secret-file), as nodes would through
a shared home directory."""
import subprocess

from leto_testing import (ROOT, base_env, events, final_digest, free_port, job_secret_file,
                          leto_cmd, run, torchrun_cmd)

SCRIPT = str(ROOT / "examples" / "gpt_inplace.py")
STEPS = 12
GEOM = ["--page-bytes", "4096", "--data-pages", "32", "--chunk-pages", "4"]
# One proc per node leaves OMP_NUM_THREADS unset (torchrun sets 1 only for several local ranks);
# multi-threaded CPU reductions are not reproducible bit for bit, so pin one thread everywhere.
ENV = {"OMP_NUM_THREADS": "1"}


def test_hof_on_one_node_promotes_shadows_on_both(tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    p = run(torchrun_cmd("--standalone", "--nproc-per-node", "2", SCRIPT, "--steps", str(STEPS),
                         "--out", str(ref)), base_env(**ENV), timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    secret = job_secret_file(tmp_path)
    procs = []
    for node in range(2):
        cmd = leto_cmd("--no-status", "--nnodes", "2", "--nproc-per-node", "1",
                       "--secret-file", str(secret),
                       "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                       "--rdzv-id", "mn-inplace", "--events", str(tmp_path / f"ev{node}.jsonl"),
                       *GEOM, "--inject", "kill:rank=1:step=5:at=rmu.update:group=1:chunk=1",
                       SCRIPT, "--steps", str(STEPS), "--out", str(out))
        procs.append(subprocess.Popen(cmd, env=base_env(**ENV), cwd=str(ROOT), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = []
    try:
        for pr in procs:
            outs.append(pr.communicate(timeout=240))
    finally:
        for pr in procs:
            pr.kill()
    assert [pr.returncode for pr in procs] == [0, 0], [o[1][-3000:] for o in outs]
    for r in range(2):
        assert final_digest(ref, r) == final_digest(out, r), f"rank {r} differs from torchrun"
    for n in (0, 1):
        evs = events(tmp_path / f"ev{n}.jsonl")
        assert any(e["event"] == "promote" and e["generation"] == 1 for e in evs), n
        assert sum(e["event"] == "rendezvous" for e in evs) == 1, n      # no restart round
