"""The device-side marker write's limits, as the Python side plans them (leto_runtime/rmu/marker.py)
against what the kernel accepts (cuda/marker_kernel.h): the constants agree, and every geometry
the configuration allows (H1 <= 16, H2 <= H1) fits; a larger one falls back to host functions."""
from __future__ import annotations

import re

import pytest

from leto_runtime.wire.kernel_cache import source_dir
from leto_runtime.rmu import marker as M

HEADER = source_dir() / "marker_kernel.h"


def _const(name: str) -> int:
    m = re.search(rf"constexpr int {name} = (\d+);", HEADER.read_text())
    assert m, f"{name} not found in {HEADER}"
    return int(m.group(1))


def test_python_limits_are_the_kernels():
    assert M.KERNEL_SEGMENTS == _const("kMaxMarkerSegments")
    assert M.KERNEL_GROUP_WORDS == 1024 * _const("kMaxMarkerWordsPerThread")


@pytest.mark.parametrize("h1,h2", [(16, 1), (16, 16), (8, 8), (1, 0), (4, 2)])
def test_every_allowed_geometry_fits(h1, h2):
    assert M._Mirror._fits(h1 + h2)


def test_more_rows_than_the_kernel_takes_fall_back():
    assert not M._Mirror._fits(33)
