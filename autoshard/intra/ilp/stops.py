"""How a stopped solve is told (jax-free): whether the clock or a count stopped it --
the plan then depends on the machine's load or not -- and the words for a solve that ran
well past its time limit (:func:`autoshard.intra.ilp.solve.solve`'s warnings)."""

from __future__ import annotations

from autoshard.intra.ilp.model import _Model
from autoshard.intra.ilp.solvers import _Outcome

# what a warning adds where a wall-clock limit, not a count, decided the plan
LOAD_DEPENDENT = (
    "a wall-clock limit decided this plan, so it depends on the machine's load: another "
    "run can return another plan"
)


def _by_clock(out: _Outcome) -> bool:
    """Whether the wall clock stopped the solve of ``out`` (its time limit), not a count
    (nodes, simplex iterations). A solve whose solver does not say which limit stopped it
    counts as stopped by the clock."""
    stopped = out.status in ("time_limit", "no_incumbent", "lp_stopped")
    return stopped and out.limit not in ("nodes", "iterations")


# a solve that ran this much past its time limit says so in the warning
OVERRUN_FACTOR, OVERRUN_GRACE_S = 1.2, 2.0


def _overrun(out: _Outcome, time_limit_s: float | None, model: _Model) -> str:
    """Words for a solve that ran well past its time limit: HiGHS checks the limit between
    its search steps, and its start-up heuristics on a very large program (the per-demand
    program on a 3-axis mesh: 1.3 million columns) run on past it with no way to stop them."""
    wall, limit = out.wall_s, time_limit_s
    if wall is None or limit is None or wall <= limit * OVERRUN_FACTOR + OVERRUN_GRACE_S:
        return ""
    return (
        f" (the solver ran {wall:.0f} s: its start-up on this {model.num_cols:,}-column program"
        " is not interrupted by the limit)"
    )
