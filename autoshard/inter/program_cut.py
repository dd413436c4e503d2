"""Cut a traced forward program into pipeline stages (jax-free).

:func:`split_stages` takes the records of one microbatch's forward (one scalar output:
the loss), its equations tagged with their layer, and contiguous layer ranges; it returns
one :class:`StageProgram` per stage: the equations it runs and what flows in and out of
it.  An equation runs on the stage of its layer, or later if an input is made later; a
stage reads the parameters it owns, the batch leaves it uses and the tensors earlier
stages send it; it sends on every tensor a later stage reads, and the last one the loss.
A parameter read by several stages (a tied embedding) is **owned** by the first stage
that reads it and sent forward like an activation, so each parameter has one copy, one
gradient and one optimizer update.  The pipeline runtime
(:mod:`autoshard.runtime.pipeline`) runs these programs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autoshard.inter.stages import equal_layer_stages
from autoshard.ir.records import TraceRecords


@dataclass(frozen=True)
class StageProgram:
    """The equations of one stage and what flows in and out of it (tensor ids)."""

    index: int
    start_layer: int
    end_layer: int
    eqns: tuple[int, ...]
    params: tuple[int, ...]  # parameters this stage owns (updates)
    received: tuple[int, ...]  # tensors from earlier stages: activations, shared params
    received_from: tuple[int, ...]  # the stage that sends each received tensor
    data: tuple[int, ...]  # batch leaves it reads
    outputs: tuple[int, ...]  # tensors later stages read, and the loss where it is made
    output_consumers: tuple[tuple[int, ...], ...]  # the stages that read each output


def split_stages(
    records: TraceRecords, layer_ranges: Sequence[tuple[int, int]]
) -> tuple[StageProgram, ...]:
    """Cut a traced forward program (one scalar output: the loss) into pipeline stages.

    ``layer_ranges`` are contiguous ``[start, end)`` ranges over ``records.layers``.
    Equations with no layer run on the first stage; an equation never runs before the
    stage that makes its inputs.  Parameters nobody reads are owned by stage 0 (their
    gradient is zero, but the optimizer still updates them, as on one device).
    """
    num_layers = max(len(records.layers), 1)
    check_layer_ranges(layer_ranges, num_layers)
    if len(records.outputs) != 1 or records.tensors[records.outputs[0]].shape != ():
        raise ValueError("the loss function must return one scalar (the mean loss)")
    loss = records.outputs[0]
    layer_stage = {}
    for s, (start, end) in enumerate(layer_ranges):
        for layer in records.layers[start:end]:
            layer_stage[layer] = s
    kinds = {t: records.tensors[t].kind for t in range(len(records.tensors))}
    source: dict[int, int] = {}  # intermediate tensor -> stage that makes it
    stage_eqns: list[list[int]] = [[] for _ in layer_ranges]
    readers: dict[int, set[int]] = {}
    for eqn in records.eqns:
        s = layer_stage.get(eqn.layer, 0)
        s = max([s] + [source[t] for t in eqn.inputs if t in source])
        stage_eqns[s].append(eqn.index)
        for t in eqn.inputs:
            if kinds[t] in ("param", "data", "intermediate"):
                readers.setdefault(t, set()).add(s)
        for t in eqn.outputs:
            source[t] = s
    if loss not in source:
        raise ValueError("the loss is not computed from the parameters and batch")
    params = [t for t in records.inputs if kinds[t] == "param"]
    for t in params:
        source[t] = min(readers.get(t, {0}))
    stages = []
    for s, (start, end) in enumerate(layer_ranges):
        reads = sorted(t for t, r in readers.items() if s in r)
        received = [t for t in reads if kinds[t] != "data" and source[t] < s]
        outputs = [
            t for t in sorted(source) if source[t] == s and any(c > s for c in readers.get(t, ()))
        ]
        if source[loss] == s:
            outputs.append(loss)
        stages.append(
            StageProgram(
                index=s,
                start_layer=start,
                end_layer=end,
                eqns=tuple(stage_eqns[s]),
                params=tuple(t for t in params if source[t] == s),
                received=tuple(received),
                received_from=tuple(source[t] for t in received),
                data=tuple(t for t in reads if kinds[t] == "data"),
                outputs=tuple(outputs),
                output_consumers=tuple(
                    tuple(sorted(c for c in readers.get(t, ()) if c > s)) for t in outputs
                ),
            )
        )
    return tuple(stages)


def check_layer_ranges(layer_ranges: Sequence[tuple[int, int]], num_layers: int) -> None:
    """Raise unless ``layer_ranges`` are non-empty, contiguous and cover ``0..num_layers``."""
    if not layer_ranges:
        raise ValueError("no stages given")
    expected = 0
    for start, end in layer_ranges:
        if start != expected or end <= start:
            raise ValueError(
                f"stage layer ranges {list(layer_ranges)} must be non-empty, contiguous and "
                f"cover layers 0..{num_layers}, e.g. {list(equal_layer_stages(num_layers, 1))}"
            )
        expected = end
    if expected != num_layers:
        raise ValueError(
            f"stage layer ranges {list(layer_ranges)} end at layer {expected}; the program "
            f"has {num_layers} layers"
        )
