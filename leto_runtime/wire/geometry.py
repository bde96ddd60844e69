"""The protection-group shape, one definition for every side.

Role: D data pages, H1 tier-1 and H2 tier-2 parity pages of S bytes per group.  The job config
(`leto_run.config.RecoveryConfig`) checks a user's values against `issues()` and says which
field to fix; the state manager checks its arguments and a kept snapshot against the same
rules; the trainer takes the pool's geometry from the state manager's hello (`of_pool`), where
the device pages are already rounded up to the GPU's allocation granularity by the one side
that knows it (`device_page_bytes`).

Calling contract:
    g = Geometry()                         # the defaults: 1024 / 16 / 1 / 2 MiB
    g.issues()                             # [Issue(field, problem, fix)]; [] when valid
    g.problems()                           # the same as one-line strings
    Geometry.from_json(d) / g.to_json()    # from_json raises GeometryError
    of_pool(hello)                         # the trainer's view: pages of device_page_bytes
    device_page_bytes(S, granularity)      # S rounded up to whole granules (0: no rounding)
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

MAX_PARITY = 16                  # the codec's exponent window (t = -7..8)
MAX_CODE_LENGTH = 65535          # GF(2^16): data + tier-1 pages of one group


class GeometryError(ValueError):
    """A geometry that breaks a rule (the message names every broken one)."""


class Issue(NamedTuple):
    field: str                   # data_pages | tier1 | tier2 | page_bytes
    problem: str
    fix: str


@dataclass(frozen=True)
class Geometry:
    """Protection-group shape: D data pages, H1 tier-1 and H2 tier-2 parity pages of S bytes."""

    data_pages: int = 1024
    tier1: int = 16
    tier2: int = 1
    page_bytes: int = 2 << 20

    def issues(self) -> list[Issue]:
        out = []
        if self.data_pages < 1:
            out.append(Issue("data_pages", f"{self.data_pages} is below 1", "use at least 1 data page"))
        if not 1 <= self.tier1 <= MAX_PARITY:
            where = "below 1" if self.tier1 < 1 else f"above {MAX_PARITY}"
            out.append(Issue("tier1", f"{self.tier1} is {where}",
                             f"use 1..{MAX_PARITY} tier-1 parity pages (the codec's exponent window)"))
        if self.tier2 < 1:
            # A group's tier-1 parity is itself protected (it can be rebuilt without the data);
            # the codec has no code with zero parity pages, so every trainer would fail.
            out.append(Issue("tier2", f"{self.tier2} tier-2 parity pages: every protection group "
                             "needs at least one (its tier-1 parity pages are protected by tier 2)",
                             f"use 1..{max(1, min(MAX_PARITY, self.tier1))} tier-2 parity pages (default 1)"))
        elif self.tier2 > min(MAX_PARITY, self.tier1):
            out.append(Issue("tier2", f"{self.tier2} is above tier1={self.tier1}",
                             f"use 1..{min(MAX_PARITY, self.tier1)} tier-2 parity pages (at most tier1)"))
        if self.page_bytes < 4096 or self.page_bytes % 4096:
            # The codec needs multiples of 1024; the pool maps whole memory pages (4 KiB).
            out.append(Issue("page_bytes", f"{self.page_bytes} is not a positive multiple of 4096",
                             "use a multiple of 4096 (and so of 1024), e.g. 2097152 (2 MiB)"))
        if self.data_pages + self.tier1 > MAX_CODE_LENGTH:
            out.append(Issue("data_pages", f"data_pages + tier1 = {self.data_pages + self.tier1} "
                             f"is above {MAX_CODE_LENGTH} (GF(2^16) code length)",
                             f"use data_pages <= {MAX_CODE_LENGTH - self.tier1}"))
        return out

    def problems(self) -> list[str]:
        """One line per issue: "tier1=40: 40 is above 16 (fix: use 1..16 ...)"."""
        return [f"{i.field}={getattr(self, i.field)}: {i.problem} (fix: {i.fix})"
                for i in self.issues()]

    def to_json(self) -> dict:
        return {"data_pages": self.data_pages, "tier1": self.tier1, "tier2": self.tier2,
                "page_bytes": self.page_bytes}

    @classmethod
    def from_json(cls, d: dict) -> "Geometry":
        try:
            g = cls(**{k: int(d[k]) for k in ("data_pages", "tier1", "tier2", "page_bytes")})
        except (KeyError, TypeError, ValueError) as e:
            raise GeometryError(f"bad geometry {d!r}: {e}") from None
        if g.problems():
            raise GeometryError("; ".join(g.problems()))
        return g


def device_page_bytes(page_bytes: int, granularity: int) -> int:
    """A device page: `page_bytes` rounded up to whole allocation granules (GPU VMM)."""
    return -(-page_bytes // granularity) * granularity if granularity > 0 else page_bytes


def of_pool(hello: dict) -> Geometry:
    """The geometry of a trainer's states in the pool that sent `hello` (its `op_hello` reply):
    the pool's groups, with the pages as big as the device allocates them."""
    g = Geometry.from_json(hello["geometry"])
    return replace(g, page_bytes=int(hello.get("device_page_bytes") or g.page_bytes))
