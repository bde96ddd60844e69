"""Where the agent's stores listen (leto_run.store_listen, leto_run.rendezvous) and where the
job's key comes from (leto_run.job_secret): loopback only for a single-node job, the
rendezvous interface for several nodes, never the wildcard; a secret file that is missing or
unsafe is a ConfigError naming the fix."""
import os
import socket
import stat

import pytest

from leto_run import job_secret
from leto_run.cli import load_config
from leto_run.errors import ConfigError
from leto_run.rendezvous import make_handler, next_round
from leto_run.store_listen import StoreBindError, bind_plan, listening_addresses, server_store
from leto_runtime.control_auth import KEY_BYTES, derive_job_key
from leto_testing import base_env, free_port, leto_cmd, run, with_env
from leto_runtime.wire import contract as C


@pytest.fixture(autouse=True)
def _agent_setting_restored(monkeypatch):
    """make_handler sets the agent's own TORCH_DISABLE_SHARE_RDZV_TCP_STORE (rendezvous.py):
    in this process it must not outlive the test (set here as the agent does: undone after)."""
    monkeypatch.setenv(C.TORCH_SHARE_RDZV_STORE_OFF, "1")

LOOPBACK = ("127.0.0.1", "::1")


def test_bind_plan():
    p = bind_plan("localhost", ("127.0.0.1",), single_node=True)
    assert (p.addresses, p.advertise) == (("127.0.0.1",), "localhost")
    # a name that is not one loopback address: loopback anyway, and clients are told so
    for resolved in (("10.1.2.3",), ("127.0.0.1", "::1"), ()):
        p = bind_plan("node7", resolved, single_node=True)
        assert (p.addresses, p.advertise) == (("127.0.0.1",), "127.0.0.1"), resolved
    with pytest.raises(StoreBindError, match="only to loopback"):    # Debian's 127.0.1.1
        bind_plan("node7", ("127.0.1.1",), single_node=False)
    assert bind_plan("node7", ("127.0.1.1", "10.1.2.3"), False).addresses == ("10.1.2.3",)
    assert bind_plan("127.0.0.1", ("127.0.0.1",), False).addresses == ("127.0.0.1",)
    p = bind_plan("node7", ("10.1.2.3", "fd00::3"), single_node=False)
    assert (p.addresses, p.advertise) == (("10.1.2.3", "fd00::3"), "node7")
    assert "0.0.0.0" not in p.addresses and "::" not in p.addresses


def test_server_store_listens_where_planned_and_refuses_a_foreign_address():
    before = set(listening_addresses(os.getpid()))
    store, plan = server_store(socket.getfqdn(), 0, single_node=True, timeout=10)
    new = set(listening_addresses(os.getpid())) - before
    assert new == {(plan.addresses[0], store.port)} and plan.addresses[0] in LOOPBACK
    store.set("k", "v")
    assert store.get("k") == b"v"
    with pytest.raises(OSError, match="--local-addr"):
        server_store("192.0.2.1", 0, single_node=False, timeout=5)   # TEST-NET: not ours
    del store


def test_single_node_rendezvous_and_worker_stores_listen_on_loopback_only():
    """The default single-node job (c10d on localhost:0): torch's rendezvous store, the
    handler's shared store and the round's worker store -- every listener is loopback, and
    the rendezvous values are signed with the job's key."""
    cfg = load_config(["--nproc-per-node", "1", "train.py"], env={})
    assert cfg.rendezvous.backend == "c10d" and cfg.launch.max_nodes == 1
    key = job_secret.job_key(cfg)
    before = set(listening_addresses(os.getpid()))
    handler, addr, port = make_handler(cfg, key)
    r = next_round(handler, round_no=0, restart_count=0, role="default", local_world_size=1,
                   master_addr=addr, master_port=port, store_timeout=30, single_node=True)
    try:
        new = set(listening_addresses(os.getpid())) - before
        assert len(new) >= 2 and all(ip in LOOPBACK for ip, _ in new), new
        assert r.master_port in {p for _, p in new}
        assert r.identities[0].global_rank == 0
        # the rendezvous store holds signed values only: a plain client reads no raw port
        raw = r.store.underlying_store.inner          # the round's PrefixStore over the AuthStore
        hits = [k for k in raw.list_keys() if k.endswith("leto/worker_store")]
        assert hits and raw.get(hits[0]) != str(r.master_port).encode()
    finally:
        handler.shutdown()


def test_static_single_node_store_listens_on_loopback():
    port = free_port()
    cfg = load_config(["--nproc-per-node", "1", "--master-addr", socket.getfqdn(),
                       "--master-port", str(port), "train.py"], env={})
    assert cfg.rendezvous.backend == "static"
    before = set(listening_addresses(os.getpid()))
    handler, addr, mport = make_handler(cfg, job_secret.job_key(cfg))
    r = next_round(handler, round_no=0, restart_count=0, role="default", local_world_size=1,
                   master_addr=addr, master_port=mport, store_timeout=30, single_node=True)
    new = set(listening_addresses(os.getpid())) - before
    assert {p for _, p in new} == {port, r.master_port} and all(ip in LOOPBACK for ip, _ in new)
    assert r.identities[0].world_size == 1


# ---- the job's key -------------------------------------------------------------------------
def _cfg(*args, env=None):
    return load_config([*args, "train.py"], env=env or {})


def test_single_node_key_is_fresh_per_job():
    cfg = _cfg("--nproc-per-node", "1")
    a, b = job_secret.job_key(cfg), job_secret.job_key(cfg)
    assert len(a) == KEY_BYTES and a != b


def _multi(tmp_path, *extra, mode="inplace"):
    return _cfg("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400",
                "--rdzv-id", "job-7", "--recovery", mode, *extra,
                env={"HOME": str(tmp_path / "home")})


def test_multi_node_key_from_a_shared_secret(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(ConfigError) as e:
        job_secret.job_key(_multi(tmp_path))
    msg = str(e.value)
    assert "rendezvous.secret_file" in msg and "does not exist" in msg and "umask 077" in msg
    assert job_secret.job_key(_multi(tmp_path, mode="restart")) is None   # torchrun's trust
    secret = os.urandom(32)
    f = tmp_path / "home" / ".config" / "leto" / "job_secret"
    f.parent.mkdir(parents=True)
    f.write_bytes(secret)
    f.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        job_secret.job_key(_multi(tmp_path))
    f.chmod(0o600)
    # the default file, or the same content elsewhere: every node derives the same key
    k = job_secret.job_key(_multi(tmp_path))
    assert k == derive_job_key(secret, "job-7") == job_secret.job_key(_multi(tmp_path, mode="restart"))
    other = tmp_path / "copy"
    other.write_bytes(secret)
    other.chmod(0o400)
    assert job_secret.job_key(_multi(tmp_path, "--secret-file", str(other))) == k
    with pytest.raises(ConfigError, match="cannot be opened"):
        job_secret.job_key(_multi(tmp_path, "--secret-file", str(tmp_path / "missing")))
    short = tmp_path / "short"
    short.write_bytes(b"x" * 8)
    short.chmod(0o600)
    with pytest.raises(ConfigError, match="8 bytes"):
        job_secret.job_key(_multi(tmp_path, "--secret-file", str(short)))


def test_secret_file_problem():
    reg = stat.S_IFREG
    uid = 1000
    assert job_secret.secret_file_problem(reg | 0o600, uid, 32, uid) is None
    assert job_secret.secret_file_problem(reg | 0o400, uid, 4096, uid) is None
    assert "mode 0640" in job_secret.secret_file_problem(reg | 0o640, uid, 32, uid)
    assert "mode 0602" in job_secret.secret_file_problem(reg | 0o602, uid, 32, uid)
    assert "uid 0" in job_secret.secret_file_problem(reg | 0o600, 0, 32, uid)
    assert "regular" in job_secret.secret_file_problem(stat.S_IFDIR | 0o700, uid, 32, uid)
    assert "31 bytes" in job_secret.secret_file_problem(reg | 0o600, uid, 31, uid)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file of another uid")
def test_secret_file_of_another_user_is_refused(tmp_path):
    f = tmp_path / "s"
    f.write_bytes(os.urandom(32))
    f.chmod(0o600)
    os.chown(f, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        job_secret.read_secret(str(f), str(f))


def test_multi_node_inplace_without_a_secret_exits_2_before_anything_starts(tmp_path):
    (tmp_path / "tmp").mkdir()
    r = run(leto_cmd("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                     f"127.0.0.1:{free_port()}", "--rdzv-id", "j", "-m", "json.tool"),
            base_env(HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path / "tmp")), timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "rendezvous.secret_file" in r.stderr and "fix:" in r.stderr
    assert list((tmp_path / "tmp").iterdir()) == []          # no run directory, no guardian
    # the fork server, forked before the agent found the problem, is stopped with it
    assert "Traceback" not in r.stderr and not with_env(f"TMPDIR={tmp_path / 'tmp'}")
