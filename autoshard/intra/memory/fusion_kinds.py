"""Which primitives XLA writes to memory (jax-free): the op kinds the memory model's parts
share (:mod:`autoshard.intra.memory.materialized`, :mod:`autoshard.intra.memory.layout_copies`),
kept apart so that neither imports the other for them.
"""

from __future__ import annotations

from autoshard.ir.primitives import ATTENTION

# Convolutions, pooling and max pooling's gradient: library calls (or their own loops)
# that read their operands from memory and write a buffer.
CONV_AND_WINDOW = frozenset(
    "conv_general_dilated reduce_window_max reduce_window_min reduce_window_sum reduce_window "
    "select_and_scatter_add select_and_gather_add".split()
)
# Ops after which XLA materialises a buffer; elementwise producers are fused into their
# consumers, reshapes are bitcasts.
MATERIALIZING = (
    frozenset(
        "dot_general gather scatter-add scatter_add reduce_sum reduce_max reduce_min argmax argmin "
        "concatenate cumsum cumprod cummax sort dynamic_update_slice transpose".split()
    )
    | CONV_AND_WINDOW
    | ATTENTION  # one kernel (or XLA's body for it) that writes its results to memory
)
