"""Activation lending on the GPU (leto_runtime/rmu/lend.py): RMU's undo/scratch and parity
buffers serve activations during forward/backward.

* region reuse really happens: tensors saved for backward lie in the lent ranges;
* a large tensor kept alive across the step raises `LendingError` (nothing is overwritten);
* peak device memory with lending <= without (+ a small tolerance), in separate processes;
* bit-exactness: examples/gpt_inplace.py under torchrun with lending == without lending, and
  leto-run in place with lending and kills in backward and inside the update == the same.

Run on the lent H200: `pytest -q -s tests/gpu/test_lend_gpu.py` (figures printed with -s)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from leto_testing import (ROOT, base_env, final_digest, leto_cmd, step_losses,  # noqa: E402
                          torchrun_cmd)

MiB = 1 << 20


def _setup(lend: bool, backend: str = "auto"):
    from gpt import GPT, GPTConfig, init_weights
    from leto_runtime.rmu.adamw import AdamWConfig
    from leto_runtime.rmu.marker import Phase
    from leto_runtime.rmu.states import Geometry, Layout, open_states
    from leto_runtime.rmu.updater import Updater

    dev = torch.device("cuda:0")
    cfg = GPTConfig(vocab_size=96, block_size=128, n_layer=2, n_head=4, n_embd=512)
    geo = Geometry(8, 4, 1, 2 * MiB)
    with torch.device("meta"):
        model = GPT(cfg)
    layout = Layout.of([(n, tuple(p.shape)) for n, p in model.named_parameters()], geo.page_bytes)
    ss = open_states(layout, client=None, geo=geo, device=str(dev), chunk_pages=2)
    layout.bind(model, ss.flat(ss.model[0]), ss.flat(ss.grads))
    init_weights(model, 0)
    up = Updater(ss, AdamWConfig(lr=1e-3, clip_grad_norm=1.0, total_steps=100), backend=backend,
                 lend=lend)
    up.encode_all([*ss.model, ss.grads])
    up.marker.write(initialized=1, t=-1, phase=Phase.DONE)
    return cfg, model, ss, up, dev


def _forward(model, cfg, dev, t, saved=None):
    from gpt import batch
    idx, tgt = batch(0, t, 0, 32, cfg, dev)
    hooks = torch.autograd.graph.saved_tensors_hooks(
        lambda x: (saved.append((x.data_ptr(), x.numel() * x.element_size())) if saved is not None
                   else None) or x, lambda x: x)
    with hooks, torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = model(idx, tgt)
    return loss


def _in(ranges, ptr):
    return any(a <= ptr < a + n for a, n in ranges)


def test_activations_land_in_rmu_memory_and_a_kept_tensor_raises():
    from leto_runtime.rmu.lend import LendingError
    cfg, model, ss, up, dev = _setup(lend=True)
    ranges = ss.lend_ranges()
    try:
        hits = []
        for t in range(3):
            up.begin(t)
            G = ss.flat(ss.grads)
            G.zero_()
            saved = []
            loss = _forward(model, cfg, dev, t, saved)
            hits.append(sum(n for p, n in saved if _in(ranges, p)))
            loss.backward()
            del loss
            up.step(t)
        st = up.lender.stats()
        print(f"\nlent bytes of saved activations per step: {hits}; allocator: {st}")
        assert st["region_allocs"] > 0 and st["region_peak"] > 0
        assert all(h > 0 for h in hits), "no activation was placed in the lent ranges"
        # a large tensor allocated in the compute phase and kept across the step
        t = 3
        up.begin(t)
        # The pool also caches the cudaMalloc'd overflow segments of earlier steps (hundreds
        # of MiB): allocate past them until the caching allocator carves from lent memory.
        keep = [torch.empty(8 * MiB, dtype=torch.uint8, device=dev) for _ in range(96)]
        inside = [k for k in keep if _in(ranges, k.data_ptr())]
        del keep
        assert inside, "no 8 MiB tensor was placed in the lent ranges"
        keep = inside[:1]
        marker_before = up.marker.rec
        before = [ss.flat(s).clone() for s in ss.model]
        with pytest.raises(LendingError, match="del logits"):
            up.step(t)
        assert up.marker.rec == marker_before
        assert all(torch.equal(b, ss.flat(s)) for b, s in zip(before, ss.model))
        with pytest.raises(LendingError):          # still alive: still refused
            up.step(t)
        del keep, inside
        up.step(t)                                 # released: the update goes on
    finally:
        up.close()


def test_empty_cache_inside_the_lending_window_gives_memory_back_as_under_torchrun():
    """A script that frees a tensor in forward and calls `torch.cuda.empty_cache()` gives it
    back to the driver, as without lending (torch's own call releases nothing of its default
    pool while allocations are routed to a pool: the reference below)."""
    from leto_runtime.rmu import lend
    cfg, model, ss, up, dev = _setup(lend=True)
    try:
        for t in range(2):
            up.begin(t)
            loss = _forward(model, cfg, dev, t)
            loss.backward()
            del loss
            up.step(t)
            if t == 0:
                keep = torch.ones(512 * MiB, dtype=torch.uint8, device="cuda:0")  # default pool
        up.begin(2)                              # inside the window
        assert up.lender.inside
        del keep
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved(0)
        lend._TORCH_EMPTY_CACHE()                # torch's call, as under plain routing
        torch_freed = before - torch.cuda.memory_reserved(0)
        torch.cuda.empty_cache()                 # what the script calls
        freed = before - torch.cuda.memory_reserved(0)
        print(f"\ninside the window: torch's empty_cache frees {torch_freed / MiB:.0f} MiB, "
              f"Leto's {freed / MiB:.0f} MiB")
        assert torch_freed < 512 * MiB <= freed
        assert up.lender.inside                  # the routing goes on
        x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda:0")
        seg = [s for s in up.lender._snapshot() if s["address"] <= x.data_ptr()
               < s["address"] + s["total_size"]]
        assert seg, "an allocation after the call no longer goes to the lending pool"
        del x
        loss = _forward(model, cfg, dev, 2)
        loss.backward()
        del loss
        up.step(2)
    finally:
        up.close()
    assert torch.cuda.empty_cache is lend._TORCH_EMPTY_CACHE


def _peak_child() -> None:
    """Child process: 4 steps of the test model; prints the device-memory peak (MiB) above the
    level before the states existed."""
    torch.zeros(1, device="cuda:0")
    free, total = torch.cuda.mem_get_info(0)
    base = total - free
    cfg, model, ss, up, dev = _setup(lend=os.environ.get("LETO_LEND", "1") == "1")
    peak = 0
    for t in range(4):
        up.begin(t)
        ss.flat(ss.grads).zero_()
        loss = _forward(model, cfg, dev, t)
        loss.backward()
        del loss
        up.step(t)
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(0)
        peak = max(peak, total - free - base)
    st = up.lender.stats() if up.lender else {}
    print("PEAK " + json.dumps({"peak_mib": peak / MiB, "region_mib": sum(
        n for _, n in ss.lend_ranges()) / MiB, "region_peak_mib": st.get("region_peak", 0) / MiB}))


def _peak(lend: bool) -> dict:
    env = dict(os.environ, LETO_LEND="1" if lend else "0",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, __file__, "peak"], env=env, capture_output=True,
                       text=True, timeout=300, cwd=str(ROOT))
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("PEAK "))
    return json.loads(line[5:])


@pytest.mark.gpu_alone
def test_peak_memory_does_not_grow_with_lending():
    on, off = _peak(True), _peak(False)
    print(f"\npeak device memory above the start: lending {on['peak_mib']:.0f} MiB, without "
          f"{off['peak_mib']:.0f} MiB (RMU buffers {on['region_mib']:.0f} MiB, lent peak "
          f"{on['region_peak_mib']:.0f} MiB)")
    assert on["region_peak_mib"] > 0
    assert on["peak_mib"] <= off["peak_mib"] + 16


SCRIPT = str(ROOT / "examples" / "gpt_inplace.py")
STEPS = 8
MODEL = ["--model", "small", "--n-layer", "4", "--n-embd", "384", "--steps", str(STEPS),
         "--batch-size", "64"]
GEOM = ["--data-pages", "8", "--tier1", "8", "--tier2", "1", "--chunk-pages", "2"]


def test_training_is_bit_exact_with_lending(tmp_path):
    runs = {
        "torchrun-nolend": (torchrun_cmd("--standalone", "--nproc-per-node", "1", SCRIPT, *MODEL,
                                         "--out", str(tmp_path / "a")), {"LETO_LEND": "0"}),
        "torchrun-lend": (torchrun_cmd("--standalone", "--nproc-per-node", "1", SCRIPT, *MODEL,
                                       "--out", str(tmp_path / "b")), {"LETO_LEND": "1"}),
        "leto-run-lend-kills": (leto_cmd(
            "--standalone", "--nproc-per-node", "1", *GEOM, "--hang-timeout", "30",
            "--inject", "kill:rank=0:step=3:at=backward",
            "--inject", "kill:rank=0:step=5:at=rmu.update:group=0:chunk=1:garbage=1",
            "--log-dir", str(tmp_path / "logs"), SCRIPT, *MODEL, "--out", str(tmp_path / "c")),
            {"LETO_LEND": "1"}),
    }
    for d in "abc":
        (tmp_path / d).mkdir(exist_ok=True)
    procs = {}
    for name, (cmd, extra) in runs.items():       # concurrently: small models, one GPU
        procs[name] = subprocess.Popen(cmd, env=base_env(**extra), cwd=str(ROOT),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = {n: p.communicate(timeout=400) for n, p in procs.items()}
    for n, p in procs.items():
        assert p.returncode == 0, f"{n}: {outs[n][1][-4000:]}"
    err = outs["leto-run-lend-kills"][1]
    print("\n" + err[err.find("Recovery report"):][:2000])
    dirs = {"torchrun-nolend": tmp_path / "a", "torchrun-lend": tmp_path / "b",
            "leto-run-lend-kills": tmp_path / "c"}
    ref = dirs["torchrun-nolend"]
    for n, d in dirs.items():
        assert final_digest(d, 0) == final_digest(ref, 0), f"{n}: final state differs"
        want, got = step_losses(ref, 0), step_losses(d, 0)
        assert sorted(got) == list(range(STEPS))
        assert all(v == want[s] for s, v in got.items()), f"{n}: losses differ"


if __name__ == "__main__" and sys.argv[1:] == ["peak"]:
    _peak_child()
