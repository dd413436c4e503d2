"""Sharding rules per primitive (jax-free): the registry, the rule families, the enumeration.

:mod:`~autoshard.intra.rules.registry` holds the registry (``RULES``, ``register``,
``Slot``, ``Strategy``, ``NodeContext``); :mod:`~autoshard.intra.rules.strategies` holds
the core primitives' rules (dots, elementwise ops, broadcasts, reshapes, gathers, ...) and
turns a node's slots into its candidate strategies. Each other family is a module that
imports the registry and registers its rules on import: ``attention`` (fused attention),
``conv`` (convolutions, pooling, ``rev``), ``moe`` (cumulative ops, ``top_k``, ``sort``,
``rev``, ``scatter``), ``reduce`` (reductions), ``slice`` (``slice``, ``pad``). No family
imports this ``__init__``; it imports every family, so whatever module of the package is
imported first, every rule is registered. The order is the import statement's (sorted):
a primitive two families register goes to the later one (``rev``: ``moe``, after ``conv``).
"""

from autoshard.intra.rules import (  # noqa: F401 - imported to register their rules
    attention,
    conv,
    moe,
    reduce,
    slice,
    strategies,
)
