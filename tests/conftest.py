"""Fixtures shared by every test tier; helpers live in tests/leto_testing.py."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d
