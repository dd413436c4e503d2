"""ParallelPlan: what autoshard decided, as plain data (jax-free, JSON round trip).

A plan fixes, on a logical mesh, the sharding spec of every program input and output and
of every node's outputs, names the strategy each node uses, and carries the predictions
that the verifier checks against XLA: the collectives (kind, mesh axes, bytes per
device) and the peak memory per device.  Baselines (data parallel, ZeRO, Megatron) are
plans too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autoshard.ir.spec import Collective, Mesh, ShardingSpec


@dataclass(frozen=True)
class ParallelPlan:
    name: str  # "auto", "dp", "zero2", "zero3", "megatron", ...
    mesh: Mesh
    input_specs: tuple[ShardingSpec, ...]  # one per program input (flat, graph.inputs order)
    input_paths: tuple[str, ...]  # pytree paths of the inputs (for reading)
    output_specs: tuple[ShardingSpec, ...]  # one per program output
    tensor_specs: Mapping[int, ShardingSpec]  # tensor id -> spec of every node output
    # node index -> operand position -> the spec that node reads it in (where it differs
    # from the producer's spec: the runtime reshards there, as the plan predicts)
    operand_specs: Mapping[int, Mapping[int, ShardingSpec]]
    node_strategies: tuple[str, ...]  # strategy name per node
    predicted_collectives: tuple[Collective, ...]
    predicted_peak_bytes: float
    objective: float
    solver: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    # what lives in host memory and what it costs (autoshard.intra.offload.placement.OffloadCost's
    # JSON, with the step time it adds up to); empty: nothing is offloaded
    offload: Mapping[str, Any] = field(default_factory=dict)

    def specs_by_tensor(self, input_ids) -> dict[int, ShardingSpec]:
        """Tensor id -> spec of every program input (``input_ids``: the graph's input
        tensor ids, in order) and every node output."""
        return {**dict(zip(input_ids, self.input_specs, strict=True)), **self.tensor_specs}

    def to_json(self) -> dict:
        out = self._to_json()
        if self.offload:
            out["offload"] = dict(self.offload)
        return out

    def _to_json(self) -> dict:
        return {
            "name": self.name,
            "mesh": {"axis_names": list(self.mesh.axis_names), "shape": list(self.mesh.shape)},
            "input_specs": [s.to_json() for s in self.input_specs],
            "input_paths": list(self.input_paths),
            "output_specs": [s.to_json() for s in self.output_specs],
            "tensor_specs": {str(k): v.to_json() for k, v in self.tensor_specs.items()},
            "operand_specs": {
                str(n): {str(k): v.to_json() for k, v in ops.items()}
                for n, ops in self.operand_specs.items()
            },
            "node_strategies": list(self.node_strategies),
            "predicted_collectives": [c.to_json() for c in self.predicted_collectives],
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "objective": self.objective,
            "solver": dict(self.solver),
            "notes": list(self.notes),
        }

    @staticmethod
    def from_json(obj: dict) -> ParallelPlan:
        return ParallelPlan(
            name=obj["name"],
            mesh=Mesh(tuple(obj["mesh"]["axis_names"]), tuple(obj["mesh"]["shape"])),
            input_specs=tuple(ShardingSpec.from_json(s) for s in obj["input_specs"]),
            input_paths=tuple(obj["input_paths"]),
            output_specs=tuple(ShardingSpec.from_json(s) for s in obj["output_specs"]),
            tensor_specs={
                int(k): ShardingSpec.from_json(v) for k, v in obj["tensor_specs"].items()
            },
            operand_specs={
                int(n): {int(k): ShardingSpec.from_json(v) for k, v in ops.items()}
                for n, ops in obj.get("operand_specs", {}).items()
            },
            node_strategies=tuple(obj["node_strategies"]),
            predicted_collectives=tuple(
                Collective.from_json(c) for c in obj["predicted_collectives"]
            ),
            predicted_peak_bytes=float(obj["predicted_peak_bytes"]),
            objective=float(obj["objective"]),
            solver=dict(obj.get("solver", {})),
            notes=tuple(obj.get("notes", ())),
            offload=dict(obj.get("offload", {})),
        )

    def dumps(self) -> str:
        return json.dumps(self.to_json())

    @staticmethod
    def loads(text: str) -> ParallelPlan:
        return ParallelPlan.from_json(json.loads(text))

    def collective_totals(self) -> dict[tuple[str, tuple[str, ...]], int]:
        totals: dict[tuple[str, tuple[str, ...]], int] = {}
        for c in self.predicted_collectives:
            key = (c.kind, c.axes)
            totals[key] = totals.get(key, 0) + c.bytes
        return totals
