"""XLA:CPU's layout copies, as the memory model counts them (jax-free).

Takes a graph and a priced mesh; returns the values a backend copies into a transposed
layout of its own, when its :class:`~autoshard.hardware.mesh.MemoryLayout` says it does:
the weights a batched dot reads in a non-canonical layout (``batched_dot_weight_copies``),
the lhs an unbatched dot reads contracted on its leading dims (``dot_lhs_copies``)
and the operands and results of convolutions (``conv_layout_copies``). Their buffers, for
the predicted peak and the ILP's memory rows, are
:mod:`autoshard.intra.memory.transposed_copies`'.
"""

from __future__ import annotations

from autoshard.hardware.mesh import DeviceMesh
from autoshard.intra.memory.fusion_kinds import MATERIALIZING
from autoshard.ir.graph import Graph, conv_dimension_numbers

NARROW_FLOATS = frozenset({"bfloat16", "float16"})


def transposed_weight_copies(graph: Graph, mesh: DeviceMesh) -> dict[int, tuple[int, ...]]:
    """Program inputs that a batched ``dot_general`` reads in a non-canonical layout, on a
    backend that copies them (``batched_dot_weight_copies``, XLA:CPU).

    XLA canonicalises a batched dot to ``lhs [batch, free, contracting]`` and
    ``rhs [batch, contracting, free]``; an operand laid out otherwise is transposed into a
    buffer of its own. For a weight that copy depends on the program inputs only, so
    XLA:CPU makes it at the start of the step: on moe-tiny's 8-device plan XLA holds the
    transposed ``wi`` and ``wo`` of the experts (for the backward dots that contract their
    last dim) at its peak. Activations and unbatched dots are left out (not measured).
    XLA makes the copy only for a dot that reads one expert a device
    (:func:`reads_one_batch_row`, in the layout the dot reads the weight): moe-tiny's
    replicated experts (data-parallel, ZeRO-2) were over-predicted by 14-20% with their
    copies counted, and its ``megatron`` plan on 4x2 (the experts' hidden dim split, 8
    experts a device) by 10.8%; the callers keep those dots out.

    Returns weight tensor id -> the dot nodes that may read a copy, in program order. The
    copy lives from the start of the step to its last reader (a resharded copy made early,
    :func:`_reshard_buffers`; in the ILP, a :class:`CopyBuffer` of every layout of the
    weight)."""
    if not mesh.memory_layout.batched_dot_weight_copies:
        return {}
    out: dict[int, list[int]] = {}
    inputs = set(graph.inputs)
    for node in graph.nodes:
        if node.primitive != "dot_general":
            continue
        (lc, rc), (lb, rb) = node.params["dimension_numbers"]
        if not lb:
            continue
        for k, (contract, batch) in enumerate(((lc, lb), (rc, rb))):
            tid = node.inputs[k]
            if tid not in inputs or graph.tensors[tid].kind in ("literal", "const", "data"):
                continue
            rank = len(graph.tensors[tid].shape)
            free = [d for d in range(rank) if d not in contract and d not in batch]
            canonical = (*batch, *free, *contract) if k == 0 else (*batch, *contract, *free)
            if tuple(canonical) != tuple(range(rank)):
                out.setdefault(tid, []).append(node.index)
    return {tid: tuple(dots) for tid, dots in out.items()}


def reads_one_batch_row(graph: Graph, dot: int, tid: int, spec, mesh: DeviceMesh) -> bool:
    """Whether ``dot`` reads ``tid`` in layout ``spec`` with one row of each batch dim a
    device (one expert of an MoE weight): where it does, XLA:CPU runs the dot on a 2-D
    slice and makes the weight's transposed copy (:func:`transposed_weight_copies`);
    where a device holds several experts it makes none (moe-tiny ``megatron`` on 4x2, 8
    experts a device: no copy at XLA's peak, 512 KiB predicted)."""
    node = graph.nodes[dot]
    (_, _), (lb, rb) = node.params["dimension_numbers"]
    batch = lb if node.inputs[0] == tid else rb
    shape = graph.tensors[tid].shape
    return all(shape[d] // mesh.mesh.size(spec.dims[d]) == 1 for d in batch)


def transposed_conv_values(graph: Graph, mesh: DeviceMesh) -> list[tuple[int, int, int]]:
    """(tensor, first, last node index) of each conv operand or result XLA:CPU transposes
    for the conv (``conv_layout_copies``): its one conv layout is (batch, spatial...,
    feature) for the input and the result and (spatial..., in, out) for the kernel; any
    other order (a weight gradient reads the activation as (feature, spatial..., batch),
    an input gradient reads the kernel with in and out swapped) costs a copy of the
    value, made just before the conv and freed after it -- or, for a program input (the
    images, a kernel) or a value computed from inputs alone (a reversed kernel,
    :func:`input_derived_values`) with ``early_input_reshards``, made at the start of
    the step (seen
    in the compiled wresnet-tiny step: ``transpose_copy_fusion`` buffers beside each
    gradient conv, the images' from the start to the stem's weight gradient). With
    ``early_conv_copies`` a backward conv's copy of a value the forward pass makes is
    made where the value is, and kept to the conv: in the compiled wresnet-tiny step on
    8 devices every ``transpose_copy_fusion`` of a weight gradient's activation is born
    in the forward pass (``transpose_copy_fusion.19``: positions 57-228 of XLA's 409, its
    conv at 228), and on 2x4 (the ILP's plan) five such 8-16 KiB copies are live at XLA's
    peak in the backward pass."""
    return [(tid, first, conv) for tid, first, conv, _ in _conv_copies(graph, mesh)]


def input_derived_values(graph: Graph) -> set[int]:
    """The program inputs and the values computed from them alone (and literals) by ops
    XLA fuses (no :data:`~autoshard.intra.memory.fusion_kinds.MATERIALIZING` op): a kernel
    reversed for its input gradient's conv. XLA:CPU makes a conv's transposed copy of such
    a value straight from the inputs, in the forward pass, and keeps it to the conv: in
    wresnet-tiny's compiled steps on 2x4 (both plans of tests/test_memory_layout_copies.py)
    every input gradient's kernel copy (``transpose_copy_fusion.23``-``.28``) is a fusion
    of the parameter alone (the ``rev`` fused into it), made at positions 54-71 of XLA's
    ~555 and live to its backward conv (``.26``, ``block_1``'s ``conv2`` kernel, 18 KiB
    on the per-demand plan: 69-318). Counting them at their convs left the model 35 KiB
    under XLA at its backward peak on that plan. The model makes them at the start of
    the step, as an input's (``early_input_reshards``)."""
    out = set(graph.inputs)
    for node in graph.nodes:  # in program order: a value's producers come first
        if node.primitive in MATERIALIZING or not node.inputs:
            continue
        if all(i in out or graph.tensors[i].kind in ("literal", "const") for i in node.inputs):
            if any(i in out for i in node.inputs):
                out.update(node.outputs)
    return out


def _conv_copies(graph: Graph, mesh: DeviceMesh) -> list[tuple[int, int, int, tuple]]:
    """:func:`transposed_conv_values` with each copy's layout: (tensor, first, conv node,
    the order of the value's dims the conv reads)."""
    layout = mesh.memory_layout
    if not layout.conv_layout_copies:
        return []
    early = input_derived_values(graph) if layout.early_input_reshards else set()
    out = []
    for node in graph.nodes:
        if node.primitive != "conv_general_dilated":
            continue
        lhs, rhs, res = conv_dimension_numbers(node.params)
        n = len(lhs)
        spatial = tuple(range(1, n - 1))
        canonical = (
            (0, n - 1, *spatial),  # lhs: batch, feature, spatial (as dims of NHWC)
            (n - 1, n - 2, *range(n - 2)),  # rhs: out, in, spatial (as dims of HWIO)
            (0, n - 1, *spatial),
        )
        values = (node.inputs[0], node.inputs[1], node.outputs[0])
        for tid, spec, want in zip(values, (lhs, rhs, res), canonical):
            if tuple(spec) != want:
                first = _conv_copy_start(graph, tid, node, early, layout)
                out.append((tid, first, node.index, tuple(spec)))
    return out


def shared_conv_copies(graph: Graph, mesh: DeviceMesh) -> list[tuple[int, int, int, tuple]]:
    """The buffers of :func:`transposed_conv_values`' copies, one where XLA shares one:
    (tensor, first, last, the convs that read it). Copies of one value made before their
    conv (a program input's at the start, a forward value's where it is made:
    ``early_input_reshards``, ``early_conv_copies``) in the same transposed layout are one
    buffer, made once and kept to the last of its convs: on wresnet-tiny's plan on 2x4
    (tests/test_memory_layout_copies.py) the output of ``block_0``, read by the weight
    gradients of ``block_1``'s ``proj`` and ``conv1``, is copied once
    (``transpose_copy_fusion.13``), not once per conv. A copy made at its conv is freed
    after it, so such copies never overlap and stay one per conv."""
    merged: dict[tuple, list] = {}
    out: list[list] = []
    for tid, first, conv, order in _conv_copies(graph, mesh):
        if first < conv and (tid, first, order) in merged:
            entry = merged[(tid, first, order)]
            entry[2] = max(entry[2], conv)
            entry[3].append(conv)
            continue
        entry = [tid, first, conv, [conv]]
        out.append(entry)
        if first < conv:
            merged[(tid, first, order)] = entry
    return [(tid, first, last, tuple(convs)) for tid, first, last, convs in out]


def conv_copy_reads(graph: Graph, mesh: DeviceMesh) -> dict[tuple[int, int], int]:
    """(value, conv node) -> node index where the conv's transposed copy of the value is
    made, for each conv that reads a copy made before it (:func:`shared_conv_copies`: a
    forward value's for a backward conv, ``early_conv_copies``; a program input's or a
    value computed from them alone, ``early_input_reshards``). Such a conv reads the
    copy, not the value: the value (or its resharded copy, from which the transposed copy
    is made) is read for it where the copy is made. On wresnet-tiny's default plan on 2x4
    (tests/test_memory_layout_copies.py) ``block_0``'s output is all-gathered over
    ``model`` for ``block_1``'s forward convs and their weight gradients; XLA:CPU frees
    the gathered value (``all-gather.3``, positions 146-150 of 554) after the forward
    convs and keeps only its transposed copy (``transpose_copy_fusion.13``, 147-285) for
    the weight gradients; so for the three values gathered so in ``block_0``."""
    return {
        (tid, conv): first
        for tid, first, _, convs in shared_conv_copies(graph, mesh)
        for conv in convs
        if first < conv
    }


def copied_kernel_values(graph: Graph, mesh: DeviceMesh) -> set[int]:
    """Values computed from the program inputs alone (:func:`input_derived_values`, not an
    input or output themselves: a reversed kernel) whose every reader is a conv that reads
    a transposed copy made from the inputs at the start of the step
    (:func:`conv_copy_reads`). XLA:CPU fuses the value into that copy and gives it no
    buffer of its own: in wresnet-tiny's compiled dp step on 8 devices the input
    gradient's kernel copy of ``block_1``'s ``conv2`` (``transpose_copy_fusion.17``,
    ``f32[3,3,32,16]``, a fusion of ``param.22`` alone, positions 58-211 of 361) is the
    only buffer of that kernel's size but the parameter until its weight gradient
    (``ynn_fusion.3``, 212); the ``rev`` the jaxpr makes for it has none. Counting it
    (18 KiB there) put the conv suite's dp rows 1.7 points higher (replayed plans)."""
    if not mesh.memory_layout.early_input_reshards:
        return set()
    copied = {key for key, first in conv_copy_reads(graph, mesh).items() if first == 0}
    boundary = set(graph.inputs) | set(graph.outputs)
    out = set()
    for tid in input_derived_values(graph) - boundary:
        readers = graph.tensors[tid].consumers
        if readers and all((tid, c) in copied for c in readers):
            out.add(tid)
    return out


def input_gradient_copy_ends(graph: Graph, mesh: DeviceMesh) -> dict[tuple[int, int], int]:
    """(value, conv node) -> the node index a transposed copy made from the program inputs
    (:func:`input_derived_values`: a reversed kernel) is last read at for that conv, where
    it is not the conv: just before the weight gradient that reads the same output
    gradient, when that comes first in program order. XLA:CPU runs a conv's input gradient
    before its weight gradient on data-parallel plans (all 8 layers of wresnet-tiny's dp
    step on 8 devices), so the kernel copy is freed before the weight gradient's result and
    its transposed copy are made; the model's program order has the weight gradient first,
    and counting the three together over-predicted the conv suite's dp rows by 11.0% (8
    and 2x4), 5.3% without. On the 2x4 plans of tests/test_memory_layout_copies.py XLA
    runs about half of the input gradients first; the peak there is elsewhere."""
    ends = {}
    derived = input_derived_values(graph)
    for tid, first, _, convs in shared_conv_copies(graph, mesh):
        if first != 0 or tid not in derived:
            continue
        for c in convs:
            node = graph.nodes[c]
            grads = [i for i in node.inputs if i != tid]
            weight_grads = [
                k
                for gr in grads
                for k in graph.tensors[gr].consumers
                if k < c
                and graph.nodes[k].primitive == "conv_general_dilated"
                and graph.nodes[k].phase == "backward"
            ]
            if weight_grads:
                ends[(tid, c)] = max(first, min(weight_grads) - 1)
    return ends


def _conv_copy_start(graph: Graph, tid: int, conv, early: set[int], layout) -> int:
    """Node index where :func:`transposed_conv_values`' copy of ``tid`` for ``conv`` is
    made: the start of the step for a program input made early (``early``:
    :func:`input_derived_values`), the value's producer for
    a forward value read by a backward conv (``early_conv_copies``), else the conv."""
    if tid in early:
        return 0
    producer = graph.tensors[tid].producer
    if (
        layout.early_conv_copies
        and producer is not None
        and conv.phase != "forward"
        and graph.nodes[producer].phase == "forward"
    ):
        return producer
    return conv.index


def folded_dot_transpose(graph: Graph, node) -> int | None:
    """The ``dot_general`` result that ``node`` transposes, if XLA writes the dot's result
    in the transposed layout itself (no transpose of its own runs), else None.

    The rule: ``node`` is a ``transpose`` of a ``dot_general``'s result, it is that
    result's only reader, the result is no program output (which keeps its own layout),
    and the permutation keeps the dot's batch dims leading and in place and either keeps or
    swaps the block of lhs free dims and the block of rhs free dims, each block in its own
    order (dims of size one left out: moving them is a bitcast) -- a GEMM's output is a
    matrix ``[M, N]`` per batch row, written either way round. JAX's transpose rule makes
    every weight gradient so (``dot_general(g, x)``, then a transpose to the kernel's
    layout). Seen in the compiled steps: XLA:GPU (jax 0.11.2, H100,
    ``benchmarks/results/gpu_fused_hlo/gpt-350m_L24_B8_fused.hlo.txt.gz``) names the
    cuBLASLt and Triton GEMMs ``.../mlp/fc/transpose``, ``.../attn/qkv/transpose``,
    ``.../mlp/proj/transpose`` and ``.../attn/proj/transpose`` and writes them in the
    kernel's layout (``custom-call.42 = (bf16[1024,4096]{1,0}, ...)`` for a ``[1024,
    4096]`` kernel), with no transpose or copy fusion after them; XLA:CPU (jax 0.12) the
    same (``dot.65 = bf16[64,256]{1,0} dot(...)`` for gpt-tiny's ``mlp/fc/transpose``);
    XLA:CPU with jaxlib 0.10 (narrow dots in f32) fuses the transpose into the update's
    loop fusions that read the gradient, so it is no pass of its own there either. A
    transpose that another op reads beside it, or of a value no dot made, is a pass."""
    if node.primitive != "transpose" or len(node.outputs) != 1 or len(node.inputs) != 1:
        return None
    tid = node.inputs[0]
    t = graph.tensors[tid]
    if t.producer is None or t.last_use >= len(graph.nodes):
        return None
    dot = graph.nodes[t.producer]
    if dot.primitive != "dot_general" or list(t.consumers) != [node.index]:
        return None
    (lc, _), (lb, _) = dot.params["dimension_numbers"]
    rank = len(t.shape)
    nb = len(lb)
    nl = len(graph.tensors[dot.inputs[0]].shape) - len(lc) - nb
    batch, lhs_free, rhs_free = range(nb), range(nb, nb + nl), range(nb + nl, rank)

    def sized(order) -> list[int]:
        return [d for d in order if t.shape[d] != 1]

    perm = sized(node.params["permutation"])
    if perm not in (sized(range(rank)), sized((*batch, *rhs_free, *lhs_free))):
        return None
    return tid


def transposed_dot_lhs(graph: Graph, mesh: DeviceMesh) -> list[tuple[int, int]]:
    """(lhs tensor, dot node index) of each unbatched ``dot_general`` whose lhs XLA:CPU
    copies into a transposed buffer (``dot_lhs_copies``).

    XLA:CPU's dots (XNNPACK, ``ynn_fusion`` in the HLO) read the lhs as
    ``[free, contracting]`` and the rhs either way: in the compiled gpt-350m bf16 step
    every one of the 27 unbatched dots has ``lhs_contracting_dims={1}``, and each weight
    gradient (``x^T @ g``, the lhs contracted on its leading dims) reads a
    ``copy_bitcast_fusion`` that transposes (and, for a bf16 lhs, widens) it just before
    the dot. The largest is the logits gradient's, ``f32[51200, 1024]`` (200 MiB), for
    the embedding's gradient, and it is at XLA's peak on the gpt-350m plans. Dims of size
    one are left out of the order (a transpose that moves only them is a bitcast). The
    copy is made from the lhs as the dot reads it and freed after the dot. Not universal:
    in small single-device programs XLA:CPU runs the weight gradient as a plain ``dot``
    that reads ``x`` as it is and writes ``g`` transposed from its own fusion instead
    (docs/truth.md); which it picks was not established."""
    if not mesh.memory_layout.dot_lhs_copies:
        return []
    return transposed_lhs_reads(graph)


def transposed_lhs_reads(graph: Graph) -> list[tuple[int, int]]:
    """(lhs tensor, dot node index) of each unbatched ``dot_general`` that reads its lhs
    contracted on other than its trailing dims (:func:`transposed_dot_lhs`, whatever the
    backend)."""
    out = []
    for node in graph.nodes:
        if node.primitive != "dot_general":
            continue
        (lc, _), (lb, _) = node.params["dimension_numbers"]
        if lb:
            continue
        tid = node.inputs[0]
        t = graph.tensors[tid]
        if t.kind in ("literal", "const") or not t.shape:
            continue
        rank = len(t.shape)
        free = [d for d in range(rank) if d not in lc]
        order = [d for d in (*free, *lc) if t.shape[d] != 1]
        if order != sorted(order):
            out.append((tid, node.index))
    return out


def dot_lhs_copy_bytes(graph: Graph, tid: int, mesh: DeviceMesh) -> int:
    """Whole bytes of :func:`transposed_dot_lhs`'s copy of ``tid``: f32 for a narrow lhs
    on a device that computes narrow dots in f32 (the widening is fused into the copy)."""
    t = graph.tensors[tid]
    narrow = mesh.memory_layout.narrow_dots_in_f32 and t.dtype in NARROW_FLOATS
    return 2 * t.nbytes if narrow else t.nbytes
