"""A decode checked against the syndromes it did not use, and one located corruption corrected.

Role: reconstruction trusts the surviving pages and parity rows of a group.  A silent
corruption among them (a flipped bit the scrub has not reached yet) would be decoded into
every rebuilt page, and training would go on with wrong values.  With e erasures among k + m
positions the decode uses e of the m syndromes; the other m - e must be zero over the completed
codeword, so they expose such a corruption at the cost of one syndrome pass (docs/PARITY.md,
"Syndromes and location").

`decode_checked(code, pages, out)`: decode the None positions of `pages` into `out`, then check.
Consistent: done.  Not: the residual syndromes locate the wrong pages symbol by symbol
(Berlekamp-Massey, `ParityCode.scrub`).  Located parity rows are taken as further erasures and
decoded again into temporary pages, and only if that result is consistent with at least
`MIN_CHECKS` syndromes left over are those rows overwritten with it.  A located data page is
not corrected: its wrong value may already have been used by the training, so no run from here
on would be the fault-free one (the scrub's rule, docs/TRUST.md).  That, and whatever cannot be
located, raises `ParityMismatch`: the caller falls back (checkpoint) and says why.  With e = m
nothing is left to check with; that is reported as unchecked.

Calling contract: `code` a `leto_runtime.parity.ParityCode`; `pages` k + m page tensors or None
(all on one device); `out` maps every None position to its destination page.  Returns a
`Checked` (positions corrected, whether the result was checked).  Synchronizes with the device.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger("leto.rmp")
MIN_CHECKS = 2      # syndromes left over to accept a corrected decode (a wrong guess passes
                    # one row at a corrupted symbol with probability 2^-16, two with 2^-32)


class ParityMismatch(RuntimeError):
    """The surviving pages of a group disagree with its parity beyond what can be located."""

    def __init__(self, what: str, lost: list[int], suspects: dict, unlocated: int, k: int):
        self.lost, self.suspects, self.unlocated = list(lost), dict(suspects), unlocated
        found = sorted(set(suspects) - set(lost))
        data = [j for j in found if j < k]
        why = (f"data page(s) {data[:8]} of the group are corrupted, and their values may "
               "already have been used by the training" if data else
               f"located at positions {found[:8] or 'none'}, {unlocated} symbol position(s) "
               "unexplained")
        super().__init__(f"{what}: after rebuilding {len(lost)} lost page(s), the surviving pages "
                         f"and parity disagree (a silent corruption besides the losses: {why}): "
                         "the rebuilt pages cannot be trusted")


@dataclass
class Checked:
    checked: bool = True                          # False: no syndrome was left to check with
    corrected: list[int] = field(default_factory=list)   # parity rows found wrong, rewritten


def _complete(pages, out) -> list:
    return [out[j] if p is None else p for j, p in enumerate(pages)]


def decode_checked(code, pages: list, out: dict, *, what: str) -> Checked:
    lost = [j for j, p in enumerate(pages) if p is None]
    if lost:
        code.decode(pages, out=out)
    if len(lost) >= code.m:
        return Checked(checked=False)
    full = _complete(pages, out)
    rep = code.scrub(full)
    if rep.consistent:
        return Checked()
    extra = sorted(set(rep.suspects) - set(lost))
    if (extra and rep.unlocated == 0 and min(extra) >= code.k
            and len(lost) + len(extra) <= code.m - MIN_CHECKS):
        tmp = {j: full[j].clone() for j in extra}
        again = [None if j in extra else p for j, p in enumerate(pages)]
        code.decode(again, out={**{j: out[j] for j in lost}, **tmp})
        if code.scrub(_complete(again, {**out, **tmp}), locate=False).consistent:
            for j in extra:
                full[j].copy_(tmp[j])
            log.warning("leto.rmp: %s: silently corrupted parity row(s) %s were located by the "
                        "leftover syndromes and corrected while rebuilding %d lost page(s)", what,
                        [j - code.k for j in extra], len(lost))
            return Checked(corrected=extra)
    raise ParityMismatch(what, lost, rep.suspects, rep.unlocated, code.k)
