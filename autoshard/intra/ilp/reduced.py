"""The reduced program (jax-free): a :class:`ShardingProblem` after :func:`~autoshard.intra.ilp.reduce._reduce`,
in block space. Made by :mod:`~autoshard.intra.ilp.reduce`, its memory rows by
:mod:`~autoshard.intra.ilp.memory_rows`; built into a solver's model by
:mod:`~autoshard.intra.ilp.model` and decoded by :mod:`~autoshard.intra.ilp.solve`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from autoshard.intra.ilp.problem import ShardingProblem


@dataclass
class _Reduced:
    """The problem after merging and folding, in block space (a block = a root)."""

    problem: ShardingProblem
    block_of: np.ndarray  # node -> block
    maps: list[np.ndarray]  # node -> node strategy for each block strategy (-1 forbidden)
    blocks: list[int]  # block -> its original node
    cols: list[np.ndarray]  # block -> strategies that get a variable (empty when fixed)
    fixed: list[int]  # block -> its only strategy, or -1 when it has variables
    offset: np.ndarray  # block -> index of its first variable
    costs: list[np.ndarray]  # block -> cost per column (shifted, >= 0)
    pairs: list[tuple[int, int, np.ndarray]] = field(default_factory=list)  # cols_a x cols_b
    constant: complex = 0.0  # real: cost; imaginary: preference (lexicographic only)
    mem_rows: list[tuple[float, np.ndarray, np.ndarray]] = field(default_factory=list)
    # copies' windows (see _copy_windows); memory-row columns >= num_strategy_cols are
    # window columns
    windows: list[tuple] = field(default_factory=list)
    num_strategy_cols: int = 0
    ties: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)  # merge=False
    # blocks eliminated before the solve, in order: (block, its cost, [(neighbour, matrix
    # block x neighbour)]); decoded in reverse, each given its neighbours' choices
    eliminated: list[tuple[int, np.ndarray, list[tuple[int, np.ndarray]]]] = field(
        default_factory=list
    )
