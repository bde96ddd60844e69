export PYTHONPATH=$PWD LETO_EXT_DIR=$PWD/.gpu_ext PYTHONUNBUFFERED=1
date -u
timeout 100 python3 -m pytest -q tests/gpu/test_rmu_fused_gpu.py 2>&1 | tail -3
timeout 90 python3 benchmarks/rmu_overhead.py --variants rmu --warmup 2 --iters 5 --json $OUT/ro_pf.json 2>&1 | grep -E "breakdown|\| rmu"
date -u
timeout 200 python3 -m pytest -q tests/gpu/test_inplace_gpu.py 2>&1 | tail -3
date -u
