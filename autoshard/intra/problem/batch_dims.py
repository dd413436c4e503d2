"""Which dim of each value is the batch dim (jax-free): the analysis behind
``IntraOptions.force_batch_dim_to_mesh_axis``, after Alpa's batch-dim map (its
``force_batch_dim_to_mesh_dim``).

:func:`batch_dim_map` gives, for every tensor of a :class:`~autoshard.ir.graph.Graph` that
carries the batch, the dim that does.  Seeds: the dim 0 of every data input (autoshard
knows its data inputs) and, as Alpa seeds it, the dim 0 of the first dot or convolution's
result (Alpa reads HLO, which does not say which parameters are data; on a model whose
first dot reads a data input, as every ported Alpa test's, the two seeds agree).  Then,
as Alpa does, one pass forward in program order (a result from its operands) and one
pass backward (an operand not yet mapped from its op's result):

* elementwise and dim-wise ops (slices, pads, concatenation, ``split``, ``select_n``,
  type conversions, pooling windows, cumulative ops): the dim of an operand of the
  result's rank whose size there is the result's (a size-1 operand dim broadcast
  against the batch does not carry it);
* ``broadcast_in_dim``: the operand's dim moves to its place in the result; a
  broadcast (new) dim of the result gives the operand nothing;
* ``reshape`` / ``squeeze``: kept where the dims up to and including it are unchanged
  (Alpa asks only the dims before it to be unchanged, so that it keeps dim 0 through
  any reshape, even one that merges it with the next; here its size must stay too, so
  that a reshape never makes a merged or a size-1 dim the batch);
* ``transpose``: permuted;
* reductions (``reduce_*``, ``argmax``/``argmin``): kept where the batch is dim 0 and
  not reduced (Alpa's rule: dim 0 only);
* ``dot_general``: a batch dim of an operand carrying it gives the result's batch dim
  there, a free (non-contracting) dim its place among the result's free dims (Alpa
  follows only an operand's first free dim); the rhs decides where both carry one, as
  in Alpa.  A contracted batch (a weight gradient, ``x^T dy``) leaves the result free;
* ``conv_general_dilated``: the input's batch dim to the result's, the kernel's output
  feature dim to the result's feature dim, and back;
* ``gather`` / ``scatter`` (``scatter-add``): operand 0's dim where the result keeps
  its rank and that dim's size (Alpa's one case);
* fused attention: dim 0 of q (forward) or of the result gradient (backward) to dim 0
  of every result, and back.

Anything else (parameters, optimizer state, iotas, constants) carries no batch, and
neither do the weights, their gradients and the optimizer update, which only meet the
batch through contracted dims.
"""

from __future__ import annotations

from autoshard.ir.primitives import ALL_REDUCTIONS, ATTENTION, ELEMENTWISE

# the ops whose strategies Alpa filters (besides the program inputs): dots and
# convolutions; the fused attention is a pair of batched dots in Alpa's HLO
FILTERED = frozenset({"dot_general", "conv_general_dilated"}) | ATTENTION

DIMWISE = frozenset(
    "select_n convert_element_type copy copy_p stop_gradient reduce_precision "
    "bitcast_convert_type rev pad slice dynamic_slice dynamic_update_slice concatenate "
    "split reduce_window reduce_window_sum reduce_window_max reduce_window_min "
    "select_and_scatter_add select_and_gather_add cumsum cumprod cummax cummin "
    "cumlogsumexp sharding_constraint optimization_barrier clamp".split()
)
GATHERS = frozenset({"gather", "scatter", "scatter-add", "scatter_add"})


def batch_dim_map(graph) -> dict[int, int]:
    """Tensor id -> its batch dim, for every tensor of ``graph`` that carries the batch
    (see the module docstring for the rules)."""
    shape = [t.shape for t in graph.tensors]
    batch: dict[int, int] = {}
    for tid in graph.inputs:
        if graph.tensors[tid].kind == "data" and shape[tid]:
            batch[tid] = 0
    first = next((n for n in graph.nodes if n.primitive in _CONV_DOT), None)
    if first is not None and shape[first.outputs[0]]:
        batch[first.outputs[0]] = 0
    for node in graph.nodes:
        _forward(node, shape, batch)
    for node in reversed(graph.nodes):
        _backward(node, shape, batch)
    return batch


_CONV_DOT = frozenset({"dot_general", "conv_general_dilated"})


def _dimwise(node) -> bool:
    return node.elementwise or node.primitive in ELEMENTWISE or node.primitive in DIMWISE


def _forward(node, shape, batch) -> None:
    p, ins, outs = node.primitive, node.inputs, node.outputs
    found: dict[int, int] = {}
    if _dimwise(node):
        for t in ins:
            d = batch.get(t)
            if d is None:
                continue
            for o in outs:
                if _same_dim(shape[t], shape[o], d):
                    found.setdefault(o, d)
    elif p == "broadcast_in_dim" and ins[0] in batch:
        where = node.params["broadcast_dimensions"][batch[ins[0]]]
        if shape[outs[0]][where] == shape[ins[0]][batch[ins[0]]]:
            found[outs[0]] = where
    elif p in ("reshape", "squeeze") and ins[0] in batch:
        if _kept_by_reshape(shape[ins[0]], shape[outs[0]], batch[ins[0]]):
            found[outs[0]] = batch[ins[0]]
    elif p == "transpose" and ins[0] in batch:
        found[outs[0]] = node.params["permutation"].index(batch[ins[0]])
    elif p in ALL_REDUCTIONS and ins[0] in batch:
        if batch[ins[0]] == 0 and 0 not in node.params["axes"]:
            found[outs[0]] = 0
    elif p == "dot_general":
        for side in (0, 1):  # the rhs last: it decides where both carry a batch
            if ins[side] in batch:
                d = _dot_result_dim(node, shape, side, batch[ins[side]])
                if d is not None:
                    found[outs[0]] = d
    elif p == "conv_general_dilated":
        lhs_spec, rhs_spec, out_spec = _conv_specs(node)
        if batch.get(ins[0]) == lhs_spec[0]:
            found[outs[0]] = out_spec[0]
        if batch.get(ins[1]) == rhs_spec[0]:
            found[outs[0]] = out_spec[1]
    elif p in GATHERS and ins[0] in batch:
        if _same_dim(shape[ins[0]], shape[outs[0]], batch[ins[0]]):
            found[outs[0]] = batch[ins[0]]
    elif p in ATTENTION:
        source = ins[0] if p.startswith("attention_fwd") else ins[-1]
        if batch.get(source) == 0:
            found.update({o: 0 for o in outs if shape[o] and shape[o][0] == shape[source][0]})
    for o, d in found.items():
        batch[o] = d  # a forward rule sets the result, as Alpa's (a seed may be replaced)


def _backward(node, shape, batch) -> None:
    p, ins, outs = node.primitive, node.inputs, node.outputs
    mapped = [o for o in outs if o in batch]
    if not mapped:
        return
    out, d = mapped[0], batch[mapped[0]]

    def give(t: int, dim: int) -> None:
        if t not in batch and shape[t]:
            batch[t] = dim

    if _dimwise(node):
        for t in ins:
            if _same_dim(shape[t], shape[out], d):
                give(t, d)
    elif p == "broadcast_in_dim":
        dims = tuple(node.params["broadcast_dimensions"])
        if d in dims and shape[ins[0]][dims.index(d)] == shape[out][d]:
            give(ins[0], dims.index(d))
    elif p in ("reshape", "squeeze"):
        if _kept_by_reshape(shape[out], shape[ins[0]], d):
            give(ins[0], d)
    elif p == "transpose":
        give(ins[0], node.params["permutation"][d])
    elif p in ALL_REDUCTIONS:
        if d == 0 and 0 not in node.params["axes"]:
            give(ins[0], 0)
    elif p == "dot_general":
        for side in (0, 1):
            operand_dim = _dot_operand_dim(node, shape, side, d)
            if operand_dim is not None:
                give(ins[side], operand_dim)
    elif p == "conv_general_dilated":
        lhs_spec, rhs_spec, out_spec = _conv_specs(node)
        if d == out_spec[0]:
            give(ins[0], lhs_spec[0])
        if d == out_spec[1]:
            give(ins[1], rhs_spec[0])
    elif p in GATHERS:
        if _same_dim(shape[ins[0]], shape[out], d):
            give(ins[0], d)
    elif p in ATTENTION and d == 0:
        for t in ins:
            if shape[t] and len(shape[t]) >= 3 and shape[t][0] == shape[out][0]:
                give(t, 0)


def _same_dim(a: tuple[int, ...], b: tuple[int, ...], d: int) -> bool:
    """Whether dim ``d`` of a tensor of shape ``a`` is dim ``d`` of one of shape ``b``
    under a dim-wise op: the same rank and the same size there."""
    return len(a) == len(b) and d < len(a) and a[d] == b[d]


def _kept_by_reshape(src: tuple[int, ...], dst: tuple[int, ...], d: int) -> bool:
    return d < len(src) and d < len(dst) and src[: d + 1] == dst[: d + 1]


def _dot_dims(node, shape, side):
    """(batch dims, free dims) of operand ``side`` of a ``dot_general``."""
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    contract, bdims = (lc, lb) if side == 0 else (rc, rb)
    rank = len(shape[node.inputs[side]])
    free = [k for k in range(rank) if k not in contract and k not in bdims]
    return tuple(bdims), free


def _dot_result_dim(node, shape, side, d) -> int | None:
    bdims, free = _dot_dims(node, shape, side)
    if d in bdims:
        return bdims.index(d)
    if d in free:
        offset = len(bdims) + (0 if side == 0 else len(_dot_dims(node, shape, 0)[1]))
        return offset + free.index(d)
    return None


def _dot_operand_dim(node, shape, side, d) -> int | None:
    bdims, free = _dot_dims(node, shape, side)
    if d < len(bdims):
        return bdims[d]
    offset = len(bdims) + (0 if side == 0 else len(_dot_dims(node, shape, 0)[1]))
    if offset <= d < offset + len(free):
        return free[d - offset]
    return None


def _conv_specs(node):
    from autoshard.ir.graph import conv_dimension_numbers

    return conv_dimension_numbers(node.params)
