"""Alpa's intra-operator integer program over abstract strategy choices (jax-free).

Takes a :class:`ShardingProblem`: for every node of an operator graph, its candidate
strategies and their costs (communication + compute seconds); for every edge a
resharding-cost matrix; optional ties between nodes; optional per-strategy memory with
live sets and a per-device budget. Returns a :class:`Solution`: one strategy per node
that minimises the total cost subject to the ties, the forbidden (infinite-cost)
choices and the memory budget.

Guarantees:

* ``Solution.objective`` is ``objective_of(problem, solution.strategy)``, evaluated in
  float64 on the original problem, not the solver's rescaled value;
* the strategy honours every tie, never picks an infinite cost and keeps
  ``peak_memory`` within the budget (up to the solver's feasibility tolerance);
* merging tied nodes (``merge=True``) changes the size of the program, not its optimum:
  a node tied to another adds no variables, so identical layers tied to a first layer
  cost nothing extra.

Formulation (Alpa, OSDI'22, section 4.2). Each variable node ("root") r has a binary
one-hot vector s_r. An edge (u, v) between different roots gets continuous
e[p, q] >= 0 with sum_q e[p, q] = s_u[p] and sum_p e[p, q] = s_v[q]; for one-hot s this
forces e = s_u s_v^T exactly, with a tighter relaxation than McCormick. The objective is
sum_r c_r . s_r + sum_(u,v) R_uv . e_uv + a constant. Memory: for every live set,
sum_v m_v . s_v <= budget. Before building the model, the code collapses tied nodes onto
their roots, folds into node costs every edge matrix that is separable
(R[p, q] = a[p] + b[q], constant matrices included) or touches a root with one allowed
strategy, sums parallel edges, and drops memory rows that duplicate, are dominated by
another row, or can never bind. With merging it also eliminates, exactly, every root with
one or two neighbours (min-sum variable elimination: chains and trees collapse, the choice
is recovered after the solve), folds roots left with one allowed strategy into their
neighbours and drops strategies that another strategy of the same root beats whatever the
neighbours pick (dead-end elimination) -- all of it, repeated until nothing changes, only
on roots whose memory does not enter a budget row. The optimum is unchanged; among equal
optima the one returned may differ from the unreduced program's -- unless the problem has
``preferences``: then ties break lexicographically. The reductions carry (cost,
preference) pairs (costs rounded to a power-of-two quantum, ``cost_quantum``, so equal
costs are equal exactly); a first solve minimises the cost, a second, started from its
plan, the preference total under a row that keeps the cost at most the first's plus the
gap it proved. A preference never buys cost, and equal-cost plans resolve by the
preferences on every solver.

Solver details that are approximate: the objective is rescaled so that its largest
coefficient is 1e5 (``OBJECTIVE_RANGE``, above the solvers' absolute tolerances) and
solved to an absolute gap of 1e-9 of that; CBC's best bound
is read from its log, which prints about 5 significant digits, so ``gap`` under CBC is
approximate; HiGHS's bound comes from ``Highs.getInfo().mip_dual_bound``. CBC treats a
random seed of 0 as "time of day", so seeds are passed to CBC as ``seed + 1``.
"""

from autoshard.intra.ilp.problem import (
    COST_QUANTUM,
    CopyBuffer,
    EdgeCost,
    InfeasibleBudgetError,
    InfeasibleProblemError,
    ShardingProblem,
    SolverTimeLimitError,
    SolverTimeLimitWarning,
    SolverUnavailableError,
    Tie,
    cost_quantum,
    objective_of,
    peak_memory,
    resolve_ties,
)
from autoshard.intra.ilp.solve import Solution, min_peak_memory, solve
from autoshard.intra.ilp.solvers import SOLVERS, solver_output_to_stderr

__all__ = [
    "COST_QUANTUM",
    "SOLVERS",
    "CopyBuffer",
    "EdgeCost",
    "InfeasibleBudgetError",
    "InfeasibleProblemError",
    "ShardingProblem",
    "Solution",
    "SolverTimeLimitError",
    "SolverTimeLimitWarning",
    "SolverUnavailableError",
    "Tie",
    "min_peak_memory",
    "objective_of",
    "peak_memory",
    "resolve_ties",
    "solve",
    "cost_quantum",
    "solver_output_to_stderr",
]
