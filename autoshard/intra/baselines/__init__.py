"""Hand-written plans (jax-free): the baselines' rule tables, and the cheapest of them when
the solver's time limit passes with no plan.

:mod:`~autoshard.intra.baselines.tables`: dp, zero2, zero3 and megatron as rules on the
inputs' pytree paths; :mod:`~autoshard.intra.baselines.fallback`: the fallback plan.
"""
