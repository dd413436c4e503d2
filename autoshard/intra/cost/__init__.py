"""The communication cost model (jax-free): collectives priced, and resharding as collectives.

:mod:`~autoshard.intra.cost.collectives` prices one collective (alpha-beta), compute and
memory time; :mod:`~autoshard.intra.cost.reshard_tiles` gives XLA's collective-permute
routes between tilings; :mod:`~autoshard.intra.cost.resharding` turns one sharding into
another as collectives and prices it, with both.
"""
