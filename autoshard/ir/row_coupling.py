"""Whether a step's forward couples the rows of its batch: the rule that says where
data-parallel replicas would compute another program (``grad_reduce="step"``,
docs/distributed.md). Jax-free: it reads equations and the batch dim of each tensor.

``dp`` replicas each run the forward and backward on ``1/dp`` of the microbatch's rows
and sum their gradients once a step. That is the microbatch's math only when every row's
values depend on that row alone, and what reduces over rows (the loss's mean) reaches the
outputs along a linear path: then the replicas' means, averaged, are the microbatch's
mean, and so are their gradients. A value that reduces over the batch dim (a *batch
statistic*: it has no batch dim and is made from values that have one) breaks that when

* (a) it flows back into a value with a batch dim (batch norm's mean subtracted from
  every row): each replica would normalise with its own rows' statistics;
* (b) it goes through a non-linear op (``log`` of a mean, a mean times a mean): the
  average of ``f`` over replicas is not ``f`` of the average;
* or the reduction itself is not a sum (a ``max`` over rows), or an op runs along the
  batch dim (a ``cumsum`` or ``sort`` over rows).

Two more ways the replicas' program differs, told by the literals that are the row count
(they differ between the two traces): the loss is a sum over rows, not a mean (the
pipeline averages the replicas' losses: each would count ``1/dp`` of the sum), and a
per-row value scaled by the row count goes through a non-linear op.

Only the forward is read: the backward of a row-separable forward is row-separable (the
gradient of a sum over rows is the sum of the rows' gradients; those sums are the
replicas' once-a-step reduction).

Per stage: the pipeline runtime averages a stage output without a batch dim over the
replicas and splits its cotangent evenly, so a statistic made in one stage and used in
a later one reaches that stage exact; a stage is coupled where a coupling equation and a
statistic it depends on run in the same stage (:meth:`RowCoupling.within`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

# reductions over rows that are sums: the replicas' results averaged are the microbatch's
SUM_REDUCTIONS = frozenset({"reduce_sum", "dot_general", "conv_general_dilated"})
# linear (affine: "add a constant" is fine) in every operand
LINEAR = frozenset(
    {
        "add",
        "add_any",
        "sub",
        "neg",
        "convert_element_type",
        "reshape",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "transpose",
        "reduce_sum",
        "copy",
        "copy_p",
        "slice",
        "concatenate",
        "pad",
        "reduce_precision",
        "stop_gradient",
        "rev",
        "real",
        "imag",
    }
)
# linear in each operand while the others are not statistics
ONE_OPERAND_LINEAR = frozenset({"mul", "dot_general", "conv_general_dilated"})
_SCALED_NON_LINEAR = "a value scaled by the row count goes through a non-linear op"
# ops that run along one axis and keep it: along the batch dim they mix rows
ALONG_AXIS = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort"})


@dataclasses.dataclass(frozen=True)
class RowCoupling:
    """One equation where the forward couples rows (module docstring).

    ``position``: the layer position (index into the trace's layers) of the stage that runs
    it, as :func:`autoshard.inter.program_cut.split_stages` places equations; ``source``:
    the position of the latest batch statistic it depends on, and ``source_eqn`` that
    statistic's equation (the coupling's own for a reduction that is not a sum)."""

    eqn: int
    primitive: str
    module_path: str
    layer: str | None
    reason: str
    position: int
    source: int
    source_eqn: int

    def within(self, start: int, end: int) -> bool:
        """Whether a stage of layers ``[start, end)`` runs it and the statistic it uses."""
        return start <= self.source and start <= self.position < end

    def describe(self) -> str:
        where = self.module_path or "the loss function"
        layer = f", layer {self.layer}" if self.layer else ""
        return f"equation {self.eqn} ({self.primitive}) in {where}{layer}: {self.reason}"


def row_couplings(
    eqns: Sequence,
    batch_dims: Mapping[int, int | None],
    layers: Sequence[str],
    *,
    loss: int | None = None,
    row_literals: Mapping[int, int] | None = None,
) -> tuple[RowCoupling, ...]:
    """The equations of ``eqns``' forward that couple rows (module docstring), in order.

    ``eqns``: a traced step's equations or graph nodes (``primitive``, ``inputs``,
    ``outputs``, ``params``, ``layer``, ``phase``, ``module_path``); those of another
    phase are skipped. ``batch_dims``: each tensor's batch dim, None (or absent: a literal,
    a constant) where it has none. ``layers``: the trace's layer tags, in order.

    With ``loss`` (the loss tensor) and ``row_literals`` (:func:`row_literals`: the
    literals that are the row count, 1, or its inverse, -1), also where the loss is not a
    mean over rows (a sum over them: the pipeline averages the replicas' losses, so theirs
    would be ``1/dp`` of it) and where a per-row value scaled by the row count goes through
    a non-linear op (its function depends on how many rows a replica holds)."""
    order = {name: i for i, name in enumerate(layers)}
    row_literals = row_literals or {}
    position: dict[int, int] = {}  # tensor -> layer position of the equation making it
    stat: dict[int, tuple[int, int]] = {}  # statistic -> (its position, its equation)
    scale: dict[int, int] = {}  # tensor -> power of the row count it scales with
    found = []
    for e in eqns:
        if e.phase != "forward":
            continue
        pos = max([order.get(e.layer, 0)] + [position.get(t, 0) for t in e.inputs])
        for t in e.outputs:
            position[t] = pos
        reason, source = _step(e, pos, stat, batch_dims)
        scaled = {t for t in e.inputs if scale.get(t, 0) and t not in row_literals}
        if reason is None and scaled and not _linear_in(e, scaled):
            reason, source = _SCALED_NON_LINEAR, (pos, e.index)
        if reason is not None:
            found.append(
                RowCoupling(e.index, e.primitive, e.module_path, e.layer, reason, pos, *source)
            )
            continue
        if source is not None:
            for t in e.outputs:
                stat[t] = source
        k = _scale(e, scale, row_literals, source == (pos, e.index))
        for t in e.outputs:
            if k:
                scale[t] = k
    if loss is not None and scale.get(loss, 0) and loss in stat:
        where, eqn = stat[loss]
        e = next(x for x in eqns if x.index == eqn)
        found.append(
            RowCoupling(
                e.index,
                e.primitive,
                e.module_path,
                e.layer,
                "the loss sums over rows rather than averaging them (the pipeline averages "
                "the replicas' losses, so each would count 1/dp of the sum)",
                where,
                where,
                eqn,
            )
        )
    return tuple(sorted(found, key=lambda c: c.eqn))


def _scale(e, scale: Mapping[int, int], row_literals: Mapping[int, int], sums: bool) -> int:
    """The power of the row count ``e``'s outputs scale with: its operands' (the largest),
    plus one for a sum over rows (``sums``), less one for a division by the row count."""
    k = max((scale.get(t, 0) for t in e.inputs if t not in row_literals), default=0)
    if sums:
        k += 1
    if e.primitive == "div" and e.inputs[1] in row_literals:
        k -= row_literals[e.inputs[1]]
    elif e.primitive == "mul":
        k += sum(row_literals.get(t, 0) for t in e.inputs)
    return k


def row_literals(full, local, replicas: int, ids) -> dict[int, int]:
    """Among tensors ``ids``, the scalar literals two traces of one step (``full`` at the
    microbatch, ``local`` at ``1/replicas`` of it; ``tensors`` with ``literal``) hold as
    the row count (``full``'s ``replicas`` times ``local``'s: 1) or its inverse (-1): a
    mean's divisor."""
    found = {}
    for t in ids:
        a, b = full.tensors[t].literal, local.tensors[t].literal
        if a is None or b is None or isinstance(a, bool) or a == b or not a or not b:
            continue
        if math.isclose(a, b * replicas, rel_tol=1e-6):
            found[t] = 1
        elif math.isclose(a * replicas, b, rel_tol=1e-6):
            found[t] = -1
    return found


def _step(e, pos: int, stat: Mapping[int, tuple[int, int]], batch_dims: Mapping[int, int | None]):
    """``(reason, source)`` for equation ``e`` at layer position ``pos``: a reason where it
    couples rows (``source``: the statistic it uses), else None and the statistic its
    outputs are (None: they are none)."""

    def rows(t: int) -> bool:
        return batch_dims.get(t) is not None

    used = {t for t in e.inputs if t in stat}
    latest = max(stat[t] for t in used) if used else None
    out_rows = any(rows(t) for t in e.outputs)
    if latest is not None and out_rows:
        return "a batch statistic flows back into per-row values", latest
    if latest is not None and not _linear_in(e, used):
        return "a batch statistic goes through a non-linear op", latest
    if not out_rows and any(rows(t) for t in e.inputs):  # a reduction over rows
        if e.primitive not in SUM_REDUCTIONS:
            return "it reduces over the batch with no sum", (pos, e.index)
        return None, (pos, e.index)
    if out_rows and e.primitive in ALONG_AXIS and _along_rows(e, batch_dims):
        return "it runs along the batch dim", (pos, e.index)
    return None, latest


def first_coupling_within(
    couplings: Sequence[RowCoupling], start: int, end: int
) -> RowCoupling | None:
    """The first of ``couplings`` a stage of layers ``[start, end)`` runs whole."""
    return next((c for c in couplings if c.within(start, end)), None)


def _linear_in(e, stats: set[int]) -> bool:
    """Whether ``e`` is linear in its operands ``stats`` (the others held fixed)."""
    if e.primitive in LINEAR:
        return True
    if e.primitive in ONE_OPERAND_LINEAR:
        return sum(t in stats for t in e.inputs) == 1
    if e.primitive == "div":  # linear in the numerator only
        return e.inputs[1] not in stats
    if e.primitive == "select_n":  # linear in the cases; the predicate picks
        return e.inputs[0] not in stats
    if e.primitive == "dynamic_slice":  # linear in the operand; the indices pick
        return not stats.intersection(e.inputs[1:])
    return False


def _along_rows(e, batch_dims: Mapping[int, int | None]) -> bool:
    """Whether ``e`` (one of :data:`ALONG_AXIS`) runs along its operand's batch dim."""
    axis = e.params.get("axis", e.params.get("dimension"))
    return axis is not None and batch_dims.get(e.inputs[0]) == axis


def row_dim(big: Sequence[int], small: Sequence[int], replicas: int) -> int | None:
    """The dim of a tensor of shape ``big`` at the microbatch that holds its rows, given its
    shape ``small`` at ``1/replicas`` of them: the one dim that shrank ``replicas``-fold,
    None where none did. ValueError where the shapes differ otherwise."""
    shrunk = [d for d, (m, n) in enumerate(zip(big, small, strict=False)) if m != n]
    if (
        len(big) != len(small)
        or len(shrunk) > 1
        or any(big[d] != small[d] * replicas for d in shrunk)
    ):
        raise ValueError(
            f"{list(big)} at the microbatch and {list(small)} at 1/{replicas} of it: not one "
            f"batch dim split {replicas} ways"
        )
    return shrunk[0] if shrunk else None


def common_forward(
    full, local, replicas: int
) -> tuple[list, dict[int, int | None], dict[int, int]]:
    """The forward equations two traces of one step share (``full`` at the microbatch,
    ``local`` at ``1/replicas`` of it; graphs or trace records: ``tensors`` and ``nodes``
    or ``eqns``) and each of their tensors' batch dims (:func:`row_dim`): all of the
    forward where ``local``'s is the same program; else those before the first equation
    that differs, less those reading or making a tensor whose shapes give no batch dim
    (a batch dim squeezed at one row a replica): what the pair can tell; and the literals
    among their operands that are the row count (:func:`row_literals`)."""
    a = [e for e in _eqns(full) if e.phase == "forward"]
    b = [e for e in _eqns(local) if e.phase == "forward"]
    shared, dims = [], {}
    for x, y in zip(a, b, strict=False):
        if (x.primitive, x.inputs, x.outputs) != (y.primitive, y.inputs, y.outputs):
            break
        try:
            found = {
                t: row_dim(full.tensors[t].shape, local.tensors[t].shape, replicas)
                for t in (*x.inputs, *x.outputs)
            }
        except ValueError:
            continue
        shared.append(x)
        dims.update(found)
    operands = {t for e in shared for t in e.inputs}
    return shared, dims, row_literals(full, local, replicas, operands)


def _eqns(program) -> Sequence:
    return program.nodes if hasattr(program, "nodes") else program.eqns


def coupled_rows_error(couplings: Sequence[RowCoupling], replicas: int) -> ValueError:
    """The refusal of ``grad_reduce="step"`` for a step whose forward couples rows at
    ``couplings`` (non-empty): the first named, with what works instead."""
    first = couplings[0]
    more = f" (and {len(couplings) - 1} more)" if len(couplings) > 1 else ""
    return ValueError(
        f"grad_reduce='step' runs {replicas} data-parallel replicas, each on 1/{replicas} of "
        f"the microbatch's rows, but the step couples rows at {first.describe()}{more} (the "
        f"batch statistic it uses is made at equation {first.source_eqn}): each replica "
        "would compute it from its own rows, another program than the one asked for. Use "
        "grad_reduce='microbatch' (--grad-reduce microbatch), or 'auto', which runs "
        "replicas only on the stages that couple no rows"
    )
