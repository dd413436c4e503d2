"""What XLA materialises: which values of a step get a buffer of their own (jax-free).

Part of the memory model (:mod:`autoshard.intra.memory.model`): fusion decides which values are
written to memory at all; the schedule and the sizes are the model's other parts.
"""

from __future__ import annotations

from autoshard.intra.memory.common_values import common_values, merged_consumers
from autoshard.intra.memory.fusion_kinds import CONV_AND_WINDOW, MATERIALIZING
from autoshard.intra.memory.layout_copies import NARROW_FLOATS, transposed_lhs_reads
from autoshard.ir.graph import Graph
from autoshard.ir.primitives import ALL_REDUCTIONS, ATTENTION, TRANSCENDENTAL

# Ops that read their operands from memory (no fusion into them).  A fused attention
# too: cuDNN's kernel is a custom call; XLA:CPU's body reads ``q, k, v`` through
# transposed copies (``transpose_copy_fusion``, one per operand) that its backward reads
# again, so what is kept for the backward is ``q, k, v``, not the q/k/v GEMM's output
# they are sliced from (gpt-tiny's fused ZeRO-3 step on 4x2: six 8 KiB copies at XLA's
# peak, where the model kept two 48 KiB GEMM outputs).
UNFUSED_CONSUMERS = (
    frozenset("dot_general gather scatter-add scatter_add concatenate".split())
    | CONV_AND_WINDOW
    | ATTENTION
)
EXPENSIVE = TRANSCENDENTAL | {"div"}  # not recomputed in the backward pass when saved
FREE_VIEWS = frozenset(
    {"reshape", "squeeze", "expand_dims", "copy", "stop_gradient", "optimization_barrier"}
)


def materialized_tensors(
    graph: Graph,
    reductions_read_memory: bool = False,
    fused_transcendentals: bool = False,
    same: dict[int, int] | None = None,
) -> set[int]:
    """Tensors that occupy memory in the compiled step (a model of XLA's fusion).

    A tensor is materialised when it is a program input or output, when an op that
    always writes a buffer made it (dots, reductions, gathers, scatters, transposes,
    concatenations), or when an unfused op reads it (a dot's operands; with
    ``reductions_read_memory``, as on XLA:CPU, whose reductions are library calls, a
    reduction's operand too).

    Cheap elementwise values (anything but transcendentals and divisions) are fused into
    every reader, the backward pass's included: XLA recomputes them there from the
    buffers they are made of (a LayerNorm's centred and normalised input, from its input
    and statistics) rather than keeping them; :func:`live_intervals` keeps those buffers
    alive until then.  A transcendental or a division read by several ops is kept; one
    made in the forward pass and read in the backward is kept unless its operands are
    kept until then anyway.

    With ``fused_transcendentals`` (XLA:GPU) transcendentals are cheap too: fused into
    every reader and recomputed in the backward pass (softmax's ``exp``).

    Values that depend on no program input (an attention mask: iota, compare,
    broadcast) never are: XLA folds them or regenerates them inside each reader's fusion.

    A value an unfused op reads through views (a slice of a kernel, squeezed, read by a
    dot: the fused program's q/k/v GEMMs) is materialised: the view is a bitcast of its
    buffer.  A value XLA's CSE merges into an earlier one
    (:func:`~autoshard.intra.memory.common_values.common_values`: a repeated computation)
    is not; the earlier value is read by the copy's readers too.
    """
    expensive = EXPENSIVE - TRANSCENDENTAL if fused_transcendentals else EXPENSIVE
    kept_when_shared = frozenset() if fused_transcendentals else TRANSCENDENTAL
    out = set(graph.inputs) | set(graph.outputs)
    data_free = data_free_tensors(graph)
    unfused = UNFUSED_CONSUMERS | (ALL_REDUCTIONS if reductions_read_memory else frozenset())
    if same is None:  # the caller's common_values(graph), when it has them
        same = common_values(graph)
    consumers = merged_consumers(graph, same)
    for node in graph.nodes:
        for tid in node.outputs:
            t = graph.tensors[tid]
            if node.primitive in FREE_VIEWS or not t.shape or tid in same:
                continue
            if tid in data_free and tid not in out:
                continue
            readers = consumers.get(tid, t.consumers)
            users = [graph.nodes[c] for c in readers]
            if node.primitive in MATERIALIZING or any(
                graph.nodes[c].primitive in unfused for c in _through_views(graph, readers)
            ):
                out.add(tid)
            elif node.primitive in kept_when_shared and len({u.index for u in users}) > 1:
                out.add(tid)  # too dear to recompute in every consumer's fusion
            elif node.primitive not in expensive:
                continue  # recomputed wherever it is read
            elif node.phase == "forward" and any(u.phase != "forward" for u in users):
                # saved for the backward pass -- unless XLA can recompute it inside the
                # backward fusion from operands that are kept until then anyway
                last = max(readers, default=t.last_use)
                recomputable = all(
                    graph.tensors[i].kind in ("literal", "const")
                    or not graph.tensors[i].shape
                    or (i in out and graph.tensors[i].last_use >= last)
                    for i in node.inputs
                )
                if not recomputable:
                    out.add(tid)
    return out


def copied_lhs_sources(
    graph: Graph, kept: set[int], narrow_dots_in_f32: bool = False
) -> dict[int, int]:
    """Values XLA:CPU keeps for a transposed dot lhs copy (``dot_lhs_copies``: a dot that
    reads its lhs transposed reads a copy made just before it,
    :func:`~autoshard.intra.memory.layout_copies.transposed_dot_lhs`).  An lhs made by cheap
    elementwise ops and read in its own fusion too is computed twice, in that fusion and in
    the copy's, so the backward pass's transcendentals and divisions in it are read by two
    fusions and kept (the fused cross-entropy's ``exp(logits - lse)``:
    ``subtract_exponential_fusion`` beside the logits gradient and its transposed copy on
    gpt-350m, 200 MiB each).  Returns them mapped to the last such dot's node index, to
    which they live (:func:`~autoshard.intra.memory.intervals.live_intervals`).  Forward ones are left to the rules above (saved or recomputed
    for the backward: on gpt-tiny's and gpt-350m's unfused steps counting them again
    over-predicted XLA:CPU by up to 45% at the embedding gradient's dot).

    With ``narrow_dots_in_f32`` (XLA:CPU up to jaxlib 0.10) a bf16/f16 lhs is left out:
    every dot reads it through an f32 copy of its own (``widened_dot_operands``), so XLA
    writes the narrow value once, transcendentals and all, and both copies read that
    buffer (gpt-350m bf16, data parallel on 8, fused program: ``multiply_convert_fusion``
    computes ``exp(logits - lse)`` into the bf16 logits gradient, which the two f32 copies
    read; no ``exp`` buffer at XLA's peak, where the model held 200 MiB: +12.3% -> +4.1%)."""
    copied: dict[int, set[int]] = {}
    for tid, dot in transposed_lhs_reads(graph):
        copied.setdefault(tid, set()).add(dot)
    out: dict[int, int] = {}
    for tid, dots in copied.items():
        if not set(graph.tensors[tid].consumers) - dots:
            continue  # made only for the copy: one fusion
        if narrow_dots_in_f32 and graph.tensors[tid].dtype in NARROW_FLOATS:
            continue  # read through f32 copies of one narrow buffer
        stack, seen = [tid], set()
        while stack:
            t = graph.tensors[stack.pop()]
            if t.id in seen or t.producer is None:
                continue
            seen.add(t.id)
            node = graph.nodes[t.producer]
            if t.id != tid and (t.id in kept or node.primitive in EXPENSIVE):
                if node.primitive in EXPENSIVE and node.phase == "backward":
                    out[t.id] = max(out.get(t.id, -1), *dots)
                continue
            if node.primitive in MATERIALIZING:
                continue
            stack += [i for i in node.inputs if graph.tensors[i].shape]
    return out


def _through_views(graph: Graph, readers) -> set[int]:
    """``readers`` and, past every free view among them (reshape, squeeze: a bitcast of
    the same buffer), the view's readers in turn."""
    out: set[int] = set()
    stack = list(readers)
    while stack:
        c = stack.pop()
        if c in out:
            continue
        out.add(c)
        node = graph.nodes[c]
        if node.primitive in FREE_VIEWS:
            for o in node.outputs:
                stack.extend(graph.tensors[o].consumers)
    return out


def data_free_tensors(graph: Graph) -> set[int]:
    """Tensors computed from literals and constants only, by ops XLA fuses or folds (no
    dots, reductions, gathers, scatters: whatever always writes a buffer)."""
    free: set[int] = set()
    for node in graph.nodes:
        if node.primitive in MATERIALIZING:
            continue
        if all(graph.tensors[i].kind in ("literal", "const") or i in free for i in node.inputs):
            free.update(node.outputs)
    return free
