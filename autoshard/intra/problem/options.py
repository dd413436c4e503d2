"""The settings of one intra-operator planning run, as one frozen object (no jax).

:class:`IntraOptions` gathers what used to be loose keywords threaded through every
signature from the CLI down to the solver: the solver and its limits, the problem's
shape (merging, layer sharing), the memory budget, the cost formulas' knobs
(:class:`~autoshard.intra.cost.resharding.CostOptions`) and the knobs Alpa users know from its
``AutoShardingOption``. The CLI builds one from its flags; the Python API takes one whole.
Every field is honoured: a setting the planner cannot meet is refused with a message,
never ignored.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

from autoshard.intra.cost.resharding import CostOptions
from autoshard.intra.ilp import SOLVERS

# where the exact per-value program is solved (IntraOptions.exact_search)
EXACT_SEARCH = ("lp", "auto", "one-axis", "always", "never")
# The per-demand solve's work budget (IntraOptions.max_nodes): branch-and-bound nodes, a
# count, so that where it stops -- and so the plan -- does not depend on the machine's
# load. Every per-demand program measured closes at its root node (bench_truth's and
# bench_intra's rows on 2x4, the CLI's wresnet-small on 2x4, every solve of
# test_exact_2d, test_alpa_ports, test_alpa_options and test_ilp: at most 3 nodes, the
# tie-breaking solve's included), so the budget changes none of their plans; it is the
# exact program's (EXACT_MAX_NODES).
PER_DEMAND_MAX_NODES = 200
# Where that budget is in charge (no memory budget), time_limit_s is only a safety net:
# the per-demand solve, and the exact one after it, stop at this many times it. A
# per-demand solve that is all root node has no count to stop it: the CLI's wresnet-small
# on 2x4 (319,631 columns) takes 118.6 s at idle -- just under the CLI's 120 s -- and
# 225-270 s of wall time at load 7-8, when a stop at 120 s kept another plan each time
# (docs/sharing.md). Five times the limit leaves that solve room on a loaded machine.
SAFETY_NET_FACTOR = 5.0


@dataclass(frozen=True)
class IntraOptions:
    """Settings of :func:`autoshard.intra.problem.build.auto_shard_graph` and the problem it solves.

    Solver: ``solver`` ("highs" through its own API, the default: 4.6x faster than CBC
    on gpt-350m 2x4 to the same optimum, docs/sharing.md; or "cbc" through PuLP),
    ``time_limit_s`` (None: no limit), ``mip_gap`` (relative, in [0, 1)) and ``seed``;
    ``max_nodes`` (default :data:`PER_DEMAND_MAX_NODES`; None: none) bounds the
    per-demand solve's branch-and-bound nodes.  Without a memory budget that count, not
    the clock, ends the per-demand solve, and ``time_limit_s`` is only its safety net: the
    per-demand solve and the exact one after it stop at :data:`SAFETY_NET_FACTOR` times
    it, so that the plan does not depend on the machine's load.  Where a wall-clock limit
    stops a solve anyway (the net, or under a memory budget the limit itself: the root
    node of a budgeted program can run for minutes) the plan says so
    (``plan.solver["load_dependent"]``) with a warning: another run, under another load,
    can return another plan.  HiGHS runs on one thread
    (:data:`~autoshard.intra.ilp.solvers.HIGHS_THREADS`: its path depends on the count).

    Problem: ``merge_elementwise`` makes binary elementwise ops follow their deepest
    operand (Alpa's rule: a smaller ILP that can miss the best plan); ``share_layers``
    ties identical layers so that the problem does not grow with depth, ``layer_period``
    at a time (the k-th of a run of identical layers shares the (k mod period)-th's
    variables): 2 (the default) reaches alternating plans such as Alpa's column/row MLP,
    1 ties every identical layer to the first; ``layer_ends`` leaves the first and last
    layer of each run untied and ties the layers between them ``layer_period`` at a time
    (gpt-tiny's first block, which reads the embedding, is best placed unlike the others:
    period 2 alone missed the proven unshared optimum by 1.3-1.8%, ends untied reached it
    on every case measured; off by default: 1.8x the variables, and planning 1.31x XLA's
    compile on gpt-350m 2x4, docs/sharing.md); ``memory_budget_bytes`` bounds the predicted
    peak per device (None: no bound).

    ``cost``: the collective cost formulas' knobs; None picks Alpa's tie-breaking
    constants on meshes in relative units (no finite peak FLOP/s, like Alpa's test mesh)
    and none on meshes in seconds (cluster presets), where a 0.1 s constant per
    all-gather would swamp real costs.

    ``exact_values`` (the default): the ILP charges each resharding once per value, as XLA
    performs it and the plan predicts it (copy and resolution nodes,
    :mod:`autoshard.intra.problem.value_edges`), so a plan's objective is the cost of its
    predicted collectives.  The exact program starts from the plan of the cheaper
    per-demand program (False: that plan alone; one edge per distinct demand on a value,
    which can charge a resharding twice) and gets 200 branch-and-bound nodes (a budget
    that does not depend on the machine's load; under a memory budget its time is also
    capped at the per-demand solve's, at least 5 s) to improve it (docs/sharing.md). With
    HiGHS the per-demand program is solved with its presolve off (2-4x faster to the same
    optimum on the GPT presets), the exact one with it on (it improved its start more
    often so); on meshes of several axes the exact program's LP relaxation is solved first
    and kept where it is integral (its hubs make it so where measured); on one axis its
    costs alone are solved first, its tie-break preferences after. Without a memory budget
    what the per-demand solve left of its safety net (:data:`SAFETY_NET_FACTOR` times the
    user's time limit) alone bounds its time.

    ``exact_search``: where the exact program is *solved* (with ``exact_values``), never
    under a memory budget except with "always" (with a budget's memory rows its root node
    alone can take minutes):

    * "lp" (the default) on meshes with at most one axis longer than 1, as "one-axis";
      on meshes of several axes where the per-demand program has at most
      :data:`~autoshard.intra.problem.exact_values.EXACT_MAX_COLUMNS` columns, the exact
      program's LP relaxation (its values read by several demands priced by hubs,
      :mod:`autoshard.intra.problem.value_edges`, which make it tight): kept where it is
      integral (then it is the exact optimum, proven); where it is fractional the integer
      program runs (200 nodes) only on an exact program of at most
      :data:`~autoshard.intra.problem.exact_values.EXACT_MIP_MAX_COLUMNS` columns, else the
      integer program around the per-demand plan (the columns where the LP and that plan
      agree fixed, at most 2,500 left free, 200 nodes; RINS), kept where cheaper, else the
      per-demand plan, priced per value; the LP gets at most
      :data:`~autoshard.intra.problem.exact_values.EXACT_LP_MAX_ITERATIONS` simplex
      iterations.  With forbidden collectives too (since 2026-11-28), not with CBC.  Rules on the program's size
      and counts, so the plan does not depend on the load (docs/sharing.md);
    * "one-axis" on meshes with at most one axis longer than 1, where it proves its
      optimum in seconds and finds cheaper plans than its start;
    * "auto" there too, and the integer program on meshes of several axes where the
      per-demand program has at most ``EXACT_MAX_COLUMNS`` columns: on Alpa's 4-layer
      conv net on 2x2 HiGHS proved the optimum at the root, 18% below the per-demand
      plan, but on 4x2 its root node alone ran past the default time limit.  Larger
      programs (bench_intra's GPT rows on 2x4 and 8x8: 54,018-54,940 columns) keep
      the per-demand plan priced per value (its objective is still its predicted cost);
    * "always" on every mesh; "never" only prices.

    Alpa's ``AutoShardingOption`` knobs:

    * ``force_batch_dim_to_mesh_axis``: Alpa's ``force_batch_dim_to_mesh_dim``. A
      batch-dim analysis finds which dim of each value carries the batch (the data
      inputs' dim 0 propagated through the program:
      :mod:`autoshard.intra.problem.batch_dims`), and, as Alpa filters them, every data
      input and every dot, convolution and fused attention whose result has a batch dim
      splits it over this mesh axis and over no other (:func:`~autoshard.intra.problem.
      ties.force_batch_dim`); on an axis of one device that dim is left unsplit (the
      other axes serve the model). Other ops are not filtered (they pay for any
      resharding to or from these), and values without a batch dim (weights, their
      gradients, optimizer state) are free. As Alpa prices an all-gather over the
      forced mesh dim at infinity, no resharding all-gathers over the axis
      (:meth:`forbidden_collectives`). An axis that does not divide such a batch dim is
      refused, naming the value.
    * ``data_parallel_axes``: what data parallelism over these mesh axes means, for every
      op and not only the inputs: every data input splits its batch dim over all of them,
      and no resharding moves a tensor's split off one of them (no all-gather or
      all-to-all over them; partial sums are still reduced over them: the gradient
      all-reduces). The ``dp`` and ``megatron`` baselines set it; a batch these axes do
      not divide is refused.
    * ``allow_mixed_mesh_shape``: False forbids splitting one tensor dimension over
      several mesh axes at once (each dimension uses at most one axis).
    * ``shard_largest_dim``: every operator splits the largest dimension of its output
      over the mesh (:func:`autoshard.intra.problem.ties.largest_dim_spec`), the heuristic of
      Alpa's intra-op ablation; the ``heuristic`` baseline sets it.

    Layout rules of the strict ``megatron`` baseline (:mod:`autoshard.intra.baselines.tables`):

    * ``keep_weight_layout``: no weight moves. Every use of a parameter or optimizer-state
      input reads it in its (pinned) spec, and every operand of the optimizer update is
      read in the spec it is made in: a gradient must come out of the backward pass in its
      parameter's layout, partial at most over ``data_parallel_axes`` (the gradient
      all-reduce of data parallelism); no gather, re-split or split update of a weight,
      its gradient or its optimizer state.
    * ``all_reduce_only``: no resharding uses a collective other than an all-reduce
      (partial sums are all-reduced in full; anything else is a local slice): no
      all-gather, all-to-all or reduce-scatter anywhere in the step, as in Megatron-LM's
      tensor parallelism, whose only collectives are all-reduces.

    With either, dots and convolutions may also compute replicated over an axis (Alpa's
    rule keeps only the strategies that split their work over the most devices): a
    replicated weight is used replicated, as Megatron-LM's MoE router is.

    Alpa's resharding knobs:

    * ``allow_all_gather`` / ``allow_all_to_all``: False forbids every resharding that
      needs an all-gather / an all-to-all (:meth:`forbidden_collectives`): such a
      resharding costs ``inf`` in the program priced per value, so a partial sum that two
      consumers want in two layouts is all-reduced once (not reduce-scattered for one and
      all-gathered for the other, which XLA would do and the per-demand program cannot
      see: where the per-demand plan needs a forbidden kind, the exact program is solved
      on every mesh). A plan that still holds one (per-demand pricing, or a solver
      fallback) carries a warning and a note.
    * ``prefer_reduce_scatter``: Alpa's post-process, as a second solve
      (:mod:`autoshard.intra.problem.alpa_passes`): every optimizer-state input the first plan
      keeps replicated over its data-parallel axes is split over them (ZeRO-2: the
      gradient all-reduce becomes a reduce-scatter, the updated parameter is
      all-gathered), the ILP re-plans around those pins, and the new plan is kept where
      it moves no more bytes than the first (Alpa: "if no communication overhead is
      introduced"); the plan's notes say which was kept and the peaks of both. Twice
      the solver time. With ``allow_mixed_mesh_shape=False`` a state input is split only
      on a dim it leaves unsplit (never over a second axis on one dim).

    ``offload``: tensor classes kept in host memory, not HBM
    (:data:`~autoshard.intra.offload.placement.OFFLOAD_CLASSES`: ``optimizer``, ``master``,
    ``gradients``; :mod:`autoshard.intra.offload.placement`): the memory rows and the predicted peak
    leave them out (and count the device's staging buffers), and with ``gradients`` the
    update's device equations cost nothing (the host runs it). The transfers' seconds are
    priced after the solve (:func:`autoshard.intra.offload.placement.offload_cost`).
    """

    solver: str = "highs"
    time_limit_s: float | None = 60.0
    mip_gap: float = 0.0
    seed: int = 0
    max_nodes: int | None = PER_DEMAND_MAX_NODES
    merge_elementwise: bool = False
    share_layers: bool = True
    layer_period: int = 2
    layer_ends: bool = False
    memory_budget_bytes: float | None = None
    cost: CostOptions | None = None
    force_batch_dim_to_mesh_axis: str | None = None
    allow_mixed_mesh_shape: bool = True
    data_parallel_axes: tuple[str, ...] = ()
    exact_values: bool = True
    exact_search: str = "lp"
    shard_largest_dim: bool = False
    keep_weight_layout: bool = False
    all_reduce_only: bool = False
    allow_all_gather: bool = True
    allow_all_to_all: bool = True
    prefer_reduce_scatter: bool = False
    offload: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.solver not in SOLVERS:
            raise ValueError(f"unknown solver {self.solver!r}; choose one of {sorted(SOLVERS)}")
        limit = self.time_limit_s
        if limit is not None and not (_real(limit) and 0 < limit < math.inf):
            raise ValueError(
                f"time_limit_s={limit!r}: give a number of seconds > 0, or None for no limit"
            )
        if not (_real(self.mip_gap) and 0.0 <= self.mip_gap < 1.0):
            raise ValueError(f"mip_gap={self.mip_gap!r} is a relative gap; give a value in [0, 1)")
        budget = self.memory_budget_bytes
        if budget is not None and not (_real(budget) and 0 < budget < math.inf):
            raise ValueError(
                f"memory_budget_bytes={budget!r}: give bytes per device > 0, or None for no budget"
            )
        period = self.layer_period
        if isinstance(period, bool) or not isinstance(period, numbers.Integral) or period < 1:
            raise ValueError(
                f"layer_period={period!r}: give an integer >= 1 (2 reaches alternating "
                "plans, 1 ties every identical layer to the first)"
            )
        nodes = self.max_nodes
        if nodes is not None and (
            isinstance(nodes, bool) or not isinstance(nodes, numbers.Integral) or nodes < 1
        ):
            raise ValueError(
                f"max_nodes={nodes!r}: give a positive whole number of branch-and-bound "
                "nodes, or None for no node limit"
            )
        if not isinstance(self.seed, numbers.Integral) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r}: give an integer >= 0")
        if self.cost is not None and not isinstance(self.cost, CostOptions):
            raise TypeError(f"cost must be a CostOptions or None, got {type(self.cost).__name__}")
        axis = self.force_batch_dim_to_mesh_axis
        if axis is not None and not (isinstance(axis, str) and axis):
            raise ValueError(
                f"force_batch_dim_to_mesh_axis={axis!r}: give a mesh axis name, or None"
            )

        if not isinstance(self.layer_ends, bool):
            raise TypeError(f"layer_ends must be True or False, got {self.layer_ends!r}")
        if not isinstance(self.exact_values, bool):
            raise TypeError(f"exact_values must be True or False, got {self.exact_values!r}")
        if self.exact_search not in EXACT_SEARCH:
            raise ValueError(
                f"exact_search={self.exact_search!r}: choose one of {', '.join(EXACT_SEARCH)}"
            )
        if not isinstance(self.shard_largest_dim, bool):
            raise TypeError(
                f"shard_largest_dim must be True or False, got {self.shard_largest_dim!r}"
            )
        for knob in (
            "keep_weight_layout",
            "all_reduce_only",
            "allow_all_gather",
            "allow_all_to_all",
            "prefer_reduce_scatter",
        ):
            if not isinstance(getattr(self, knob), bool):
                raise TypeError(f"{knob} must be True or False, got {getattr(self, knob)!r}")
        if not isinstance(self.offload, tuple):
            raise TypeError(f"offload must be a tuple of class names, got {self.offload!r}")
        from autoshard.intra.offload.placement import Offload

        object.__setattr__(self, "offload", Offload(self.offload).classes)  # checked, ordered
        dp_axes = self.data_parallel_axes
        if not (
            isinstance(dp_axes, tuple)
            and all(isinstance(a, str) and a for a in dp_axes)
            and len(set(dp_axes)) == len(dp_axes)
        ):
            raise ValueError(
                f"data_parallel_axes={dp_axes!r}: give a tuple of distinct mesh axis names, "
                "e.g. ('data',), or () for none"
            )

    def replace(self, **changes) -> IntraOptions:
        """A copy with ``changes`` (validated like a new one)."""
        return dataclasses.replace(self, **changes)

    def forbidden_collectives(self) -> frozenset[str]:
        """The collective kinds no resharding may use under these options: a kind (over
        any axes), or ``kind@axis`` for one over that mesh axis
        (:func:`collective_forbidden`): ``force_batch_dim_to_mesh_axis`` forbids
        all-gathers over its axis, as Alpa prices them (infinite) on the forced mesh dim,
        so that data parallelism there only all-reduces."""
        kinds = set()
        if self.force_batch_dim_to_mesh_axis is not None:
            kinds.add(f"all-gather@{self.force_batch_dim_to_mesh_axis}")
        if self.all_reduce_only:
            kinds |= {"all-gather", "all-to-all", "reduce-scatter", "collective-permute"}
        if not self.allow_all_gather:
            kinds.add("all-gather")
        if not self.allow_all_to_all:
            kinds.add("all-to-all")
        return frozenset(kinds)

    def cost_options(self, relative_units: bool) -> CostOptions:
        """``cost``, or the default for a mesh in relative units / in seconds."""
        return self.cost if self.cost is not None else CostOptions(tie_breakers=relative_units)


def collective_forbidden(kind: str, axes, forbidden: frozenset[str]) -> bool:
    """Whether a collective of ``kind`` over mesh ``axes`` is in ``forbidden``
    (:meth:`IntraOptions.forbidden_collectives`: the kind, or the kind over one of
    ``axes``)."""
    return kind in forbidden or any(f"{kind}@{a}" in forbidden for a in axes)


def held_forbidden(collectives, forbidden: frozenset[str]) -> list[str]:
    """The entries of ``forbidden`` that ``collectives`` (``(kind, axes)`` pairs) use,
    sorted."""
    held = set()
    for kind, axes in collectives:
        held |= {kind} & forbidden
        held |= {f"{kind}@{a}" for a in axes} & forbidden
    return sorted(held)


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)


DEFAULT_INTRA_OPTIONS = IntraOptions()


def solve_time_limit(options) -> float | None:
    """The wall-clock limit of the per-demand solve (and of the exact one after it) under
    ``options``: :data:`SAFETY_NET_FACTOR` times
    ``time_limit_s`` where a node budget (``max_nodes``) ends it and no memory budget
    makes its root node the whole solve -- a safety net far above the solve, so that the
    count, not the machine's load, decides the plan -- else ``time_limit_s``."""
    limit = options.time_limit_s
    if limit is None or options.max_nodes is None or options.memory_budget_bytes is not None:
        return limit
    return SAFETY_NET_FACTOR * limit
