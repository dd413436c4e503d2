"""The intra-operator problem (jax-free): op graph + mesh -> ILP -> plan.

:mod:`~autoshard.intra.problem.build` builds and solves it (``build_problem``,
``auto_shard_graph``) from the run's :mod:`~autoshard.intra.problem.options`;
:mod:`~autoshard.intra.problem.records` holds the records its parts share;
:mod:`~autoshard.intra.problem.ties` shapes the problem (ties, Alpa's options),
:mod:`~autoshard.intra.problem.value_edges` and
:mod:`~autoshard.intra.problem.exact_values` price each value once,
:mod:`~autoshard.intra.problem.predict` reads the plan and its collectives off a solution,
and :mod:`~autoshard.intra.problem.alpa_passes` applies Alpa's plan-level options around
the solve.
"""
