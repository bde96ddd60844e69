"""The iteration-time model (leto_sim/iteration.py) against hand-computed cases and, for the
bucket overlap queue, against a brute-force tick-by-tick simulation of the serial channel."""
from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from leto_sim.config import Collective, load_config
from leto_sim.iteration import (bucket_finish_times, bucket_sizes, collective_time,
                                exposed_communication, iteration_time, pipeline_time,
                                young_interval)

ROOT = Path(__file__).resolve().parents[2]


def test_pipeline_time_by_hand():
    # (M + (S-1)/v) * max stage: S = 3 stages, the slowest takes 2 s.
    assert pipeline_time(4, [1.0, 2.0, 1.5]) == pytest.approx((4 + 2) * 2.0)
    assert pipeline_time(4, [1.0, 2.0, 1.5], virtual=2) == pytest.approx((4 + 1) * 2.0)
    assert pipeline_time(1, [0.5]) == pytest.approx(0.5)          # one stage: no bubble


def test_megatron_bucket_sizes():
    assert bucket_sizes(120e6, 4) == [40e6, 40e6, 40e6]           # floor of 40M parameters
    assert bucket_sizes(100e6, 64) == [64e6, 36e6]                # 1M * dp above 40 dp
    assert bucket_sizes(580e6, 1024) == [580e6]                   # one partial bucket
    assert sum(bucket_sizes(123_456_789, 8)) == pytest.approx(123_456_789)


def test_collective_alpha_beta():
    c = Collective(latency=0.0, bandwidth=1e9, algorithm="all_reduce")
    assert collective_time(1e9, 4, c) == pytest.approx(2 * 3 / 4)
    rs = Collective(latency=1e-3, bandwidth=1e9, algorithm="reduce_scatter")
    assert collective_time(1e9, 4, rs) == pytest.approx(1e-3 + 3 / 4)
    assert collective_time(1e9, 1, rs) == 0.0                     # nothing to synchronize


def test_exposed_communication_by_hand():
    # Three equal buckets over W = 10: ready at 10/3, 20/3, 10; each takes 1 -> f3 = 11, E = 1.
    assert exposed_communication([1, 1, 1], [1, 1, 1], 10.0) == pytest.approx(1.0)
    # Transfers longer than the gaps: the channel is the bottleneck; f3 = 10/3 + 3*4.
    assert exposed_communication([1, 1, 1], [4, 4, 4], 10.0) == pytest.approx(10 / 3 + 12 - 10)
    # Everything hidden except the last bucket's own transfer.
    assert exposed_communication([1, 1], [0.1, 0.1], 10.0) == pytest.approx(0.1)


def brute_force_channel(ready: list[int], transfer: list[int]) -> list[int]:
    """Tick-by-tick simulation of one serial channel taking buckets in order: each tick, if
    the channel is idle and the next bucket's gradients are ready, it starts that bucket."""
    finish, nxt, busy_until, t = [], 0, 0, 0
    while nxt < len(ready):
        if t >= busy_until and t >= ready[nxt]:
            busy_until = t + transfer[nxt]
            finish.append(busy_until)
            nxt += 1
            continue                      # the channel may start nothing else this tick
        t += 1
    return finish


@pytest.mark.parametrize("seed", range(25))
def test_queue_matches_brute_force(seed):
    rnd = random.Random(seed)
    n = rnd.randint(1, 12)
    ready = sorted(rnd.randint(0, 60) for _ in range(n))
    transfer = [rnd.randint(0, 15) for _ in range(n)]
    assert bucket_finish_times(ready, transfer) == brute_force_channel(ready, transfer)


def test_small_config_iteration_time_by_hand():
    it = iteration_time(load_config(ROOT / "configs/sim/small.yaml").workload)
    # Stages: 2*(20+40) ms + 1 ms p2p, + 5 ms embedding first, + 10 ms head last -> max 131 ms.
    assert it.pipeline == pytest.approx((8 + 3 / 1) * 0.131)
    # Three 40M-parameter buckets of FP32 gradients, reduce-scatter over dp 4 at 100 Gb/s.
    w = (50e-6 + 0.75 * 40e6 * 4 / 12.5e9) * 1.1
    window = 0.080                         # the last (slowest) stage's backward time
    f1 = window / 3 + w
    f2 = max(2 * window / 3, f1) + w
    f3 = max(window, f2) + w
    exposed = f3 - window
    assert it.buckets == 3 and it.exposed == pytest.approx(exposed)
    assert it.sync == pytest.approx(exposed + 0.1 * (3 * w - exposed))
    # Optimizer step plus the all-gather of 120M BF16 parameters.
    assert it.update == pytest.approx(0.030 + 50e-6 + 0.75 * 120e6 * 2 / 12.5e9)
    assert it.total == pytest.approx(it.pipeline + it.sync + it.update)


def test_young_interval():
    assert young_interval(0.5, 600.0, 1.5) == pytest.approx(20.0)
    assert math.isinf(young_interval(0.5, math.inf, 1.5))
