"""The memory model (jax-free): one model of the buffers a compiled step holds, its copy rules as parts.

:mod:`~autoshard.intra.memory.model` is the model (buffers, live intervals, the peak, the
ILP's memory rows); each other module is one rule it applies: ``materialized`` (which
values get a buffer of their own) on ``common_values`` (values XLA computes once),
``reshard_copies`` (a buffer per value and resharded layout, and the ``CopyGroup`` the other
copy rules share), ``layout_copies`` (which values XLA:CPU copies into a transposed layout)
and ``transposed_copies`` (those copies' buffers), ``update_zeros`` (the zeros an in-place
update writes into), ``broadcast_buffers`` (broadcasts kept from the forward to the
backward) and ``attention_workspace`` (the fused attention's own temporaries). The parts
import no model; the model imports them.
"""
