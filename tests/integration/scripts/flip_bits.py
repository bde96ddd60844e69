"""examples/gpt_inplace.py with a silent bit flip in its own retained memory (a test's fault).

    flip_bits.py WHAT:STATE:GROUP:STEP [gpt_inplace args...]

WHAT is p1 (a tier-1 parity row of the group), p2 (its tier-2 row) or data (a data page);
STATE 0..2 (params, exp_avg, exp_avg_sq); GROUP the group index within the state.  At the
boundary of step STEP (rank 0, generation 0 only) one bit is flipped in place -- nothing is told to the
state manager, as with a real silent flip -- and the scrub runs at a budget that sweeps every
group at each boundary, so it reaches the flip before the training needs that parity.
"""
import os
import runpy
import sys

import leto_runtime.resume as R

what, state, group, step = sys.argv[1].split(":")
state, group, step = int(state), int(group), int(step)
sys.argv = [os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples",
                         "gpt_inplace.py")] + sys.argv[2:]
_boundary = R.boundary


def boundary(job, t):
    if job.guard is not None and job.guard.scrubber is not None:
        job.guard.scrubber.budget = 1e6          # the whole state at every boundary
    if t == step and job.ctx.generation == 0 and job.rank == 0:
        st = job.ss.model[state]
        rows = {"p1": lambda: st.tier1(group)[1], "p2": lambda: st.tier2(group)[0],
                "data": lambda: st.group_pages(group)[3]}[what]()
        rows[1234] ^= 0x04
    _boundary(job, t)


R.boundary = boundary      # Job.steps() calls resume.boundary(job, t) before each step
runpy.run_path(sys.argv[0], run_name="__main__")
