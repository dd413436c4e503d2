"""The exact per-value program on meshes of several axes (jax-free).

The default program charges a value's resharding once per demand; the exact one once per
value (:mod:`autoshard.intra.problem.value_edges`), which is larger. :func:`solve_exact` solves
it from the per-demand plan within a node budget, or keeps the per-demand plan where the
exact one is not solved (:func:`kept_per_demand`); :func:`price_per_value` prices an
assignment the exact way without building that program.  Called by
:func:`autoshard.intra.problem.build.auto_shard_graph`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import TYPE_CHECKING

from autoshard.hardware.mesh import DeviceMesh
from autoshard.intra.ilp import SolverTimeLimitWarning, objective_of, solve
from autoshard.intra.ilp.solve import LOAD_DEPENDENT
from autoshard.intra.problem.value_edges import hub_max_sets, hubbed_values, value_edges

if TYPE_CHECKING:
    from autoshard.intra.problem.records import IntraProblem, _Common


# The exact program's budget, past the per-demand solve that gives its start: a number of
# branch-and-bound nodes, so that where it stops -- and so the plan -- does not depend on
# the machine's load; its time bounded by the user's limit alone (what the per-demand
# solve left of it). Under a memory budget (exact_search="always" only) its time is capped
# too, as a safety (the root node of a program with memory rows can take minutes): at
# EXACT_TIME_FACTOR times the per-demand solve's time, at least EXACT_MIN_SECONDS. Until
# 2026-11-28 that cap held on every one-axis program, and gpt-tiny's exact program (its
# tie-break preferences reduced lexicographically, 4-6 s) reached its optimum below load 4
# and stopped 0.8-1.4% above it at load 4-7; its first solve now runs on the costs alone
# (solve's ties_after: 0.6 s, docs/sharing.md). The old budget before that, time alone
# (half the per-demand time, at least 0.5 s), stopped most one-axis solves mid-root.
EXACT_MAX_NODES = 200
EXACT_TIME_FACTOR = 1.0
EXACT_MIN_SECONDS = 5.0
# exact_search="auto" solves the exact program on a mesh of several axes where the
# per-demand program (solved first) has at most this many columns: a rule on the
# program's size, so the plan does not depend on the load.  Alpa's 4-layer conv net on
# 2x2 (21,596 columns) proves its per-value optimum at the root of the exact program;
# gpt-350m on 2x4 (84,977) improved nothing in 120 s, and every GPT preset of
# bench_intra has 82,000-85,000 (docs/sharing.md)
EXACT_MAX_COLUMNS = 40_000
# exact_search="lp" (the default) on a mesh of several axes, within EXACT_MAX_COLUMNS:
# the exact program's LP relaxation, kept where it is integral (then it is the proven
# optimum); where it is fractional the integer program runs (EXACT_MAX_NODES nodes) only
# on an exact program of at most this many columns, else the integer program around the
# per-demand plan (the columns where the LP and that plan agree fixed; the ILP solver's
# NEIGHBOURHOOD_MAX_FREE, EXACT_MAX_NODES nodes a round, NEIGHBOURHOOD_ROUNDS rounds), kept
# where cheaper.
# Measured (benchmarks/studies/exact_lp_integral.py): the MLPs' fractional programs
# (1,250-1,316 columns) prove their optimum in under 0.5 s; the conv nets' (19,430-39,407)
# took 12-36 s, one over a minute at load 7 (its root node alone 135 s); around the
# per-demand plan (74-926 columns free) they reach 0-1.4% of that integer program's best
EXACT_MIP_MAX_COLUMNS = 2_500
# and its LP gets at most this many simplex iterations (a count, not seconds, so the plan
# does not depend on the load): the LPs kept where measured took at most 11,250 (the
# 4-layer conv net on 2x2, 43,324 columns); with forbidden collectives
# (benchmarks/studies/exact_lp_forbidden.py, 2026-11-28) gpt-tiny's with
# allow_all_gather=False on 2x4 (46,533 columns) 31,630 (11 s), with
# force_batch_dim_to_mesh_axis on 2x4 and 4x2 19,877-20,886 (1.6-2.7 s), the strict
# megatron baseline's 8,229-15,152 (integral). At 20,000 (2026-11-28) the forced cases
# stopped just short, keeping plans 26% dearer than RINS finds once the LP is through
# (exact_lp_forbidden_iter200k_2026-11-28.json); 32,000 lets every LP measured finish
EXACT_LP_MAX_ITERATIONS = 32_000
# Over EXACT_MAX_COLUMNS, "lp" still solves the LP (at most EXACT_WIDE_LP_MAX_ITERATIONS
# simplex iterations, then the integer program around the per-demand plan) on a program of
# at most EXACT_WIDE_MAX_COLUMNS columns where hubs price at least EXACT_WIDE_MIN_HUB_SHARE
# of the values several demands read (:func:`hub_share`): a hub prices a value's every set
# of wanted specs at once and keeps the LP tight, where copy nodes charge each spec through
# an OR the LP splits at will. Measured on bench_truth's 2-D rows over the column rule
# (benchmarks/studies/wide_exact_signal.py, docs/sharing.md): wresnet-tiny (8 layers) on
# 2x4, hubs on 80 of its 106 such values, LP within 4.8-6.8% of the plan found, 27,823-
# 35,702 iterations, 5-9% cheaper plans; every GPT and MoE row 21-26 of 80-105, LP bounds
# 17-66% below the plan and nothing cheaper found, for 17-42 s more (so bench_intra's GPT
# rows, planned under their compile time, are not admitted). Counts, not seconds: the plan
# does not depend on the load.
EXACT_WIDE_MAX_COLUMNS = 120_000
EXACT_WIDE_MIN_HUB_SHARE = 0.5
EXACT_WIDE_LP_MAX_ITERATIONS = 40_000


def _stopped(solution) -> str:
    """Where the exact program stopped: its node budget or its time (the user's limit, or
    its cap under a memory budget), and its own gap (against a
    bound that is weak on these programs), the per-demand status and gap being the plan's."""
    at = {
        "nodes": f"its {EXACT_MAX_NODES}-node budget",
        "time": f"its time limit ({solution.seconds:.3g} s)",
    }.get(solution.limit, f"its budget ({EXACT_MAX_NODES} nodes or its time limit)")
    gap = "" if solution.gap is None else f" (its gap {solution.gap:.3g})"
    return f"stopped at {at}{gap}, keeping its best plan"


def price_per_value(c: _Common, choice) -> float:
    """The exact (per-value) program's objective of ``choice`` -- an assignment of the real
    nodes, the values' extra nodes set as XLA's behaviour implies
    (:meth:`ValueEdges.complete`) -- without building that program: its values are priced
    at the chosen strategies only, by the same :func:`value_edges` on a program whose every
    real node has its one chosen strategy. A use that wants the producer's own chosen spec
    is free and left out (a follower; the full program drops the tied ones, and any other
    such use costs nothing there either). ``tests/test_value_edges.py`` checks it against
    ``objective_of`` on the built program."""
    n = len(c.strategies)
    chosen = [(c.strategies[i][choice[i]],) for i in range(n)]
    cap = hub_max_sets(c.mesh)
    if "hubbed" not in c.memo:  # the values the full program prices by a hub
        c.memo["hubbed"] = hubbed_values(c.values, c.strategies, c.ties, cap, c.memo)
    hubbed = c.memo["hubbed"]
    values, hub_only = [], []
    for i, v in enumerate(c.values):
        have = chosen[v.src][0].output_specs[v.k]
        uses = tuple(
            u
            for u in v.uses
            if (want := chosen[u.dst][0].input_specs[u.slot]) is not None and want != have
        )
        if uses:
            if i in hubbed:
                hub_only.append(len(values))
            values.append(dataclasses.replace(v, uses=uses, steps=(v.steps[choice[v.src]],)))
    per_value = value_edges(
        values, chosen, (None,) * n, c.mesh, c.cost_options, True, None,
        c.options.forbidden_collectives(), cap, frozenset(hub_only), c.chains,
    )  # fmt: skip
    full = per_value.complete(chosen, (0,) * n, c.mesh)
    return (
        math.fsum(c.node_costs[v][choice[v]] for v in range(n))
        + math.fsum(e.costs[choice[e.src]][choice[e.dst]] for e in c.edges)
        + math.fsum(e.costs[full[e.src]][full[e.dst]] for e in per_value.edges)
    )


def hub_share(c: _Common) -> float:
    """The share of the values read by several distinct demands (each wanting some spec)
    that the exact program prices by a hub on ``c``'s mesh (0 without hubs, 1 without such
    values): the signal that admits a program over :data:`EXACT_MAX_COLUMNS`."""
    cap = hub_max_sets(c.mesh)
    if not cap:
        return 0.0
    if "hubbed" not in c.memo:
        c.memo["hubbed"] = hubbed_values(c.values, c.strategies, c.ties, cap, c.memo)
    hubbed, distinct = c.memo["hubbed"], c.memo["distinct"]
    read = sum(  # every value of several uses (hubbed_values fills ``distinct``)
        1
        for v in distinct.values()
        if len(v.uses) > 1
        and any(s.input_specs[u.slot] is not None for u in v.uses for s in c.strategies[u.dst])
    )
    return len(hubbed) / read if read else 1.0


def wide_admitted(columns: int | None, share: float | None) -> bool:
    """Whether exact_search="lp" solves the LP of a per-demand program of ``columns``
    columns over :data:`EXACT_MAX_COLUMNS` whose values have hub share ``share``."""
    return (
        columns is not None
        and share is not None
        and columns <= EXACT_WIDE_MAX_COLUMNS
        and share >= EXACT_WIDE_MIN_HUB_SHARE
    )


def _wide_refusal(columns: int | None, share: float | None) -> str:
    """Why :func:`wide_admitted` refused a program over the column rule (empty where the
    share was not measured): the hub share, the size, or both."""
    if share is None or columns is None:
        return ""
    under = share < EXACT_WIDE_MIN_HUB_SHARE
    why = f"its values are {share:.0%} hubbed" + (
        f", under {EXACT_WIDE_MIN_HUB_SHARE:.0%}" if under else ""
    )
    if columns > EXACT_WIDE_MAX_COLUMNS:
        why += f"{' and' if under else ', but'} it is over {EXACT_WIDE_MAX_COLUMNS:,} columns"
    return (
        " (nor admitted as a program whose values hubs mostly price, at least "
        f"{EXACT_WIDE_MIN_HUB_SHARE:.0%} of them on at most {EXACT_WIDE_MAX_COLUMNS:,} "
        f"columns: {why})"
    )


def unsolved_because(
    mesh: DeviceMesh,
    search: str,
    budgeted: bool = False,
    columns: int | None = None,
    solver: str = "highs",
    share: float | None = None,
) -> str | None:
    """Why :attr:`IntraOptions.exact_search` does not solve the exact program on
    ``mesh`` (under a memory budget when ``budgeted``), or None where it does.
    ``columns``: the per-demand program's, which "lp" and "auto" read on a mesh of several
    axes (None: not solved yet, so not solved there either).  Forbidden collectives do not
    keep "lp" from solving it (until 2026-11-28 they did): under the LP's iteration cap it
    found plans 7.5% cheaper with force_batch_dim_to_mesh_axis, and never a dearer one, for
    1.3-2.7 s more (benchmarks/studies/exact_lp_forbidden.py, docs/sharing.md).
    ``share``: the program's :func:`hub_share`; with "lp", a program over the column rule
    is solved where :func:`wide_admitted` says so."""
    if search == "always":
        return None
    if search == "never":
        return "not solved (exact_search='never')"
    several = sum(1 for n in mesh.mesh.shape if n > 1) > 1
    if several and search == "one-axis":
        return "not solved on this mesh of several axes (exact_search='one-axis')"
    if several and search == "lp" and solver != "highs":
        return (
            f"not solved on this mesh of several axes with {solver} (exact_search='lp' "
            "solves the exact program's LP relaxation with HiGHS)"
        )
    if budgeted:  # with memory rows its root node alone ran past 45 s on gpt-350m (2 blocks)
        return f"not solved under a memory budget (exact_search={search!r})"
    if several and (columns is None or columns > EXACT_MAX_COLUMNS):
        if search == "lp" and wide_admitted(columns, share):
            return None
        size = "" if columns is None else f" ({columns:,} columns)"
        return (
            f"not solved on this mesh of several axes: the per-demand program{size} is "
            f"over the {EXACT_MAX_COLUMNS:,} columns up to which exact_search={search!r} "
            "solves it" + (_wide_refusal(columns, share) if search == "lp" else "")
        )
    return None


class held_warnings:
    """Hold the warnings of a solve until the plan's objective is known (:meth:`release`):
    a time-limit warning names the objective the solver saw, which pricing per value, the
    exact program or a fallback plan can change, and the plan printed beside it must not
    show another number (a 2x2x2 mesh printed 1.45819e+07 in the warning and 1.445e+07 in
    the plan)."""

    def __enter__(self):
        self._catch = warnings.catch_warnings(record=True)
        self.caught = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)
        if exc[0] is not None:  # no plan: say what the solver said, as it said it
            self.release(None)
        return False

    def release(self, objective: float | None) -> None:
        """Issue the held warnings; a time-limit warning that names another objective than
        ``objective`` (the plan's) names the plan's, and what the solver's program charged."""
        caught, self.caught = self.caught, []
        for w in caught:
            text = str(w.message)
            if issubclass(w.category, SolverTimeLimitWarning) and objective is not None:
                text = _restated(text, objective)
            warnings.warn_explicit(text, w.category, w.filename, w.lineno)


_SAID = re.compile(r"(the plan's )?objective ([-+]?[0-9.]+(?:e[-+]?[0-9]+)?)")


def _restated(text: str, objective: float) -> str:
    said = _SAID.search(text)
    if said is None or math.isclose(float(said.group(2)), objective, rel_tol=1e-5):
        return text
    if said.group(1):  # restated already (a nested hold): the newer plan's objective
        return text[: said.start(2)] + f"{objective:.6g}" + text[said.end(2) :]
    return (
        text[: said.start()]
        + f"the plan's objective {objective:.6g} (priced per value, or a fallback plan's; "
        f"the program the solver stopped on charged its own plan {said.group(2)})"
        + text[said.end() :]
    )


def kept_per_demand(first, strategy, priced: float, unsolved: str | None):
    """The per-demand solution ``first`` as the plan (assignment ``strategy``, objective
    its per-value price ``priced``) where the exact program is not solved (``unsolved``,
    the reason, goes into ``exact_stopped`` where the per-demand program over-charged its
    plan); None where it is solved, on every mesh.  A plan the per-demand program charged
    exactly its per-value price is no proof: that program prices each demand apart, so a
    plan it over-charges can still cost less per value (until 2026-11-28 such a plan was
    kept unsearched on one-axis meshes; bench_truth's gpt-tiny on 8 then cost 0.75% over
    the exact program's optimum, and 13 of its 28 planned one-axis rows 0.02-1.05%,
    docs/sharing.md).  Never where the price is infinite: priced per value the plan needs
    a collective the options forbid (all_reduce_only: a partial sum two consumers want in
    two specs, reduced once into one and resharded to the other), which only the exact
    program can avoid."""
    if unsolved is None or math.isinf(priced):
        return None
    if priced >= first.objective * (1 - 1e-9):
        return dataclasses.replace(first, strategy=strategy, objective=priced)
    return dataclasses.replace(
        first,
        strategy=strategy,
        objective=priced,
        exact_stopped=f"{unsolved}; the per-demand plan is priced per value",
    )


def solve_exact(
    ip: IntraProblem, demand: IntraProblem, mesh, settings, unsolved: str | None = None,
    first=None, lp_only: bool = False, lp_iterations: int | None = None,
):  # fmt: skip
    """Solve the exact per-value program from the per-demand program's plan (a starting
    point HiGHS needs: alone it finds no good plan on 2-D meshes), and set the extra
    nodes as XLA's behaviour implies, so the objective is the predicted resharding.

    The per-demand solve runs under the user's settings (its time-limit warning is the
    user's).  The exact program then gets :data:`EXACT_MAX_NODES` branch-and-bound nodes
    within what the per-demand solve left of the time limit (under a memory budget at most
    :data:`EXACT_TIME_FACTOR` times the per-demand time, at least
    :data:`EXACT_MIN_SECONDS`) and, out of that budget, keeps the
    best plan it found -- the start at worst.  The solution's status says which:
    "optimal" (proven on the exact program), the per-demand status and gap otherwise,
    with ``exact_stopped`` (and the exact gap) in the plan's solver record.  Given
    ``unsolved`` (why not, :func:`unsolved_because`) the exact program is not solved: the
    per-demand plan is priced per value (``exact_stopped`` says so where that price is
    below the per-demand one).  ``lp_only`` (exact_search="lp"): on a mesh with hubs, a
    fractional relaxation of a program over :data:`EXACT_MIP_MAX_COLUMNS` gets the integer
    program around the per-demand plan alone, kept where cheaper, else the per-demand plan
    (``exact_stopped`` says which, with the LP's bound); ``lp_iterations``: its LP's cap
    (None: :data:`EXACT_LP_MAX_ITERATIONS`)."""
    if first is None:
        with held_warnings() as held:
            first = solve(demand.problem, **settings)
            solution = _from_start(ip, mesh, settings, unsolved, first, lp_only, lp_iterations)
        held.release(solution.objective)
        return solution
    return _from_start(ip, mesh, settings, unsolved, first, lp_only, lp_iterations)


def _fractional(first, initial, start_price, solution, lp_iterations: int):
    """The per-demand plan where exact_search="lp" found the exact program's relaxation
    fractional on a program too large for its integer program (and nothing cheaper around
    the per-demand plan), or the LP stopped."""
    if solution.status == "lp_stopped":
        at = {"iterations": f"its {lp_iterations:,} simplex iterations"}.get(
            solution.limit, "the time limit"
        )
        why = (
            f"the exact program's LP relaxation ({solution.num_variables:,} columns) stopped "
            f"at {at} (exact_search='lp'): the per-demand plan is kept, priced per value"
        )
    else:
        gap = "" if solution.gap is None else f", at most {solution.gap:.1%} above its optimum"
        why = (
            f"the exact program's LP relaxation is fractional ({solution.num_variables:,} "
            f"columns, over the {EXACT_MIP_MAX_COLUMNS:,} up to which exact_search='lp' runs "
            f"its integer program): the per-demand plan is kept, priced per value{gap}"
        )
    return dataclasses.replace(
        first,
        strategy=initial,
        objective=start_price,
        seconds=first.seconds + solution.seconds,
        exact_stopped=why,
    )


def _from_start(ip, mesh, settings, unsolved, first, lp_only=False, lp_iterations=None):
    """:func:`solve_exact` past the per-demand solve ``first``."""
    if lp_iterations is None:
        lp_iterations = EXACT_LP_MAX_ITERATIONS
    initial = ip.values.complete(ip.strategies, first.strategy, mesh)
    start_price = objective_of(ip.problem, initial)
    kept = kept_per_demand(first, initial, start_price, unsolved)
    if kept is not None:
        return kept
    hubs = hub_max_sets(mesh) > 0
    # the LP alone only where the per-demand plan is a plan: priced per value it may need a
    # collective the options forbid (infinite), which only the integer program can avoid
    lp_only = lp_only and hubs and math.isfinite(start_price)
    # no time cap of its own (the node budget ends it): with hubs the LP relaxation comes
    # first, and a cap there made the plan depend on the load (the 4-layer conv net on
    # 2x2: its optimum at load 12, its start kept at load 15, the relaxation cut at 14 s);
    # on one axis the 5 s cap did (gpt-tiny, docs/sharing.md). Under a memory budget a cap
    # stays, as a safety: the root node of a program with memory rows can take minutes
    budgeted = ip.problem.memory_budget_bytes is not None
    cap = max(EXACT_MIN_SECONDS, EXACT_TIME_FACTOR * first.seconds) if budgeted else math.inf
    limit = settings["time_limit_s"]
    if limit is not None:  # what the per-demand solve left of the user's limit
        cap = min(cap, max(limit - first.seconds, min(limit, 0.5)))
    elif math.isinf(cap):
        cap = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SolverTimeLimitWarning)  # our own budget
        # HiGHS's presolve off pays on the per-demand program (2-4x faster, docs/sharing.md),
        # not on this one: with it, the exact program improved its start more often.  With
        # hubs (meshes of several axes) its relaxation is tight: the LP first (the conv
        # net of tests/test_exact_2d.py: integral, about 2x faster than the MIP's root).
        # Without, its first solve runs on the costs alone and the tie-break after it
        # (ties_after): the lexicographic program's equal-cost strategies made that solve
        # 4-6x slower on gpt-tiny (docs/sharing.md)
        solution = solve(
            ip.problem,
            **{**settings, "time_limit_s": cap, "max_nodes": EXACT_MAX_NODES},
            initial=initial,
            presolve=True,
            lp_first=hubs,
            ties_after=not hubs,
            mip_max_columns=EXACT_MIP_MAX_COLUMNS if lp_only else None,
            lp_max_iterations=lp_iterations if lp_only else None,
        )
    kept = _kept_after(ip, mesh, first, initial, start_price, solution, lp_iterations)
    # a clock that stopped either solve decided the plan (Solution.load_dependent); the
    # per-demand solve warned of its own, this says the exact one's
    if solution.load_dependent and not first.load_dependent:
        warnings.warn(
            f"the exact program's solve stopped at its time limit ({cap:.3g} s); {LOAD_DEPENDENT}",
            SolverTimeLimitWarning,
            stacklevel=2,
        )
    clock = first.load_dependent or solution.load_dependent
    return dataclasses.replace(kept, load_dependent=clock)


def _kept_after(ip, mesh, first, initial, start_price, solution, lp_iterations):
    """:func:`_from_start`'s plan once the exact program's ``solution`` is in: that plan
    where it is proven or no dearer than the per-demand plan (``initial``, priced
    ``start_price``), else the per-demand plan, with what stopped the exact program."""
    if solution.status in ("fractional", "lp_stopped"):
        return _fractional(first, initial, start_price, solution, lp_iterations)
    strategy = ip.values.complete(ip.strategies, solution.strategy, mesh)
    objective = objective_of(ip.problem, strategy)
    if solution.status == "neighbourhood":
        if not objective < start_price * (1 - 1e-9):  # nothing cheaper around the start
            return _fractional(first, initial, start_price, solution, lp_iterations)
        bound = "" if solution.gap is None else f", at most {solution.gap:.1%} above its optimum"
        rounds = solution.neighbourhood_rounds or 1
        again = (
            ""
            if rounds == 1
            else f", then {rounds - 1} more round{'s' if rounds > 2 else ''} around the plan "
            "it found"
        )
        return dataclasses.replace(
            first,
            strategy=strategy,
            objective=objective,
            seconds=first.seconds + solution.seconds,
            nodes=solution.nodes,
            neighbourhood_free=solution.neighbourhood_free,
            neighbourhood_rounds=solution.neighbourhood_rounds,
            exact_stopped=(
                f"the exact program's LP relaxation is fractional ({solution.num_variables:,} "
                f"columns, over the {EXACT_MIP_MAX_COLUMNS:,} up to which exact_search='lp' runs "
                "its integer program): the integer program around the per-demand plan (the "
                f"{solution.neighbourhood_free:,} columns of the nodes where the LP and that "
                f"plan differ free, {EXACT_MAX_NODES} nodes{again}) found this plan, "
                f"{1 - objective / start_price:.1%} cheaper than the per-demand one{bound}"
            ),
        )
    if solution.fallback is not None or not objective <= start_price * (1 + 1e-9):
        # the cap ran out before the solver held even its start (the LP relaxation first,
        # on a loaded machine: it then hands back a greedy plan): keep the start
        return dataclasses.replace(
            first,
            strategy=initial,
            objective=start_price,
            seconds=first.seconds + solution.seconds,
            exact_stopped=_stopped(solution).replace(
                "keeping its best plan", "with nothing better: the per-demand plan is kept"
            ),
        )
    proven = solution.status == "optimal"
    return dataclasses.replace(
        solution,
        strategy=strategy,
        objective=objective,
        status="optimal" if proven else first.status,
        gap=solution.gap if proven else first.gap,
        seconds=first.seconds + solution.seconds,
        fallback=None if proven else first.fallback,
        exact_stopped=None if proven else _stopped(solution),
    )
