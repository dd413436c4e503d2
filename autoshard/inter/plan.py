"""What the inter-operator pass decides, as plain data (jax-free, JSON round trip).

* :class:`Stage`: the one pipeline stage type: layers ``[start_layer, end_layer)`` on a
  sub-mesh viewed as a ``(dp, tp)`` logical mesh, with its predicted latency and memory.
  The stage DP (:mod:`autoshard.inter.stages`) fills the cost fields; the search
  (:mod:`autoshard.inter.search`) adds the layer names and device ids.
* :class:`StagePlan`: the stage DP's answer (stages, Alpa's objective, what it cost).
* :class:`StageSpecs`: one stage's intra-op plan on the ids of the whole step's graph.
* :class:`InterPlan`: the full search's answer: stages with names and devices, the DP's
  plan, each stage's intra-op plan and what the search cost.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from autoshard.ir.spec import ShardingSpec

Shape2 = tuple[int, int]
LOGICAL_AXES = ("data", "model")  # the axes of a stage's (dp, tp) logical mesh
# where a stage reduces its data-parallel gradient: every microbatch, or once a step
GRAD_REDUCE_MODES = ("microbatch", "step")


@dataclass(frozen=True)
class Stage:
    """Layers ``[start_layer, end_layer)`` on one sub-mesh, viewed as ``logical_mesh``.

    ``latency_s``: one microbatch, forward + backward (+ the update, amortised over the
    microbatches); ``peak_bytes``: per device, with ``microbatches_in_flight``
    microbatches' activations held.  ``layers`` (names) and ``device_ids`` are empty where
    the stage DP, which knows neither, made the stage.  ``offload``: the placement label of
    the training state it keeps in host memory (``"none"``, ``"optimizer"``,
    ``"optimizer,master"``, ...; :mod:`autoshard.inter.stage_offload`).
    ``grad_reduce``: where the data-parallel gradient is reduced: ``"microbatch"`` (in
    every microbatch's backward) or ``"step"`` (the stage runs ``dp`` replicas of a plan
    over ``model`` only and reduces once, in the update: :mod:`autoshard.runtime.stage`).
    """

    start_layer: int
    end_layer: int
    submesh: Shape2
    logical_mesh: Shape2
    latency_s: float
    peak_bytes: float
    microbatches_in_flight: int
    recompute: str = "none"  # activation recompute of its inner layers
    layers: tuple[str, ...] = ()
    device_ids: tuple[int, ...] = ()
    offload: str = "none"  # offload placement (what it keeps in host memory)
    # "microbatch": the data-parallel gradient reduced in every microbatch's backward;
    # "step": ``dp`` replicas of a plan over ``model`` on 1/dp of the microbatch's rows,
    # their gradients reduced once per step (GRAD_REDUCE_MODES)
    grad_reduce: str = "microbatch"

    def __post_init__(self) -> None:
        if self.grad_reduce not in GRAD_REDUCE_MODES:
            raise ValueError(
                f"grad_reduce must be one of {GRAD_REDUCE_MODES}, got {self.grad_reduce!r}"
            )

    @property
    def num_devices(self) -> int:
        return self.submesh[0] * self.submesh[1]

    def to_json(self) -> dict:
        return {
            "start_layer": self.start_layer,
            "end_layer": self.end_layer,
            "submesh": list(self.submesh),
            "logical_mesh": list(self.logical_mesh),
            "latency_s": self.latency_s,
            "peak_bytes": self.peak_bytes,
            "microbatches_in_flight": self.microbatches_in_flight,
            "recompute": self.recompute,
            "layers": list(self.layers),
            "device_ids": list(self.device_ids),
            "offload": self.offload,
            "grad_reduce": self.grad_reduce,
        }

    @staticmethod
    def from_json(obj: dict, offload: str = "none") -> Stage:
        """``offload``: the placement of a file written before stages had their own (the
        plan's, which every stage then took)."""
        return Stage(
            start_layer=obj["start_layer"],
            end_layer=obj["end_layer"],
            submesh=tuple(obj["submesh"]),
            logical_mesh=tuple(obj["logical_mesh"]),
            latency_s=obj["latency_s"],
            peak_bytes=obj["peak_bytes"],
            microbatches_in_flight=obj["microbatches_in_flight"],
            recompute=obj.get("recompute", "none"),
            layers=tuple(obj.get("layers", ())),
            device_ids=tuple(obj.get("device_ids", ())),
            offload=obj.get("offload", offload),
            grad_reduce=obj.get("grad_reduce", "microbatch"),
        )


@dataclass(frozen=True)
class StagePlan:
    """The chosen stages, the pipeline latency they give, and what the search cost."""

    stages: tuple[Stage, ...]
    objective_s: float
    search_seconds: float
    num_cost_calls: int
    num_microbatches: int
    schedule: str
    num_dp_runs: int = 0

    def to_json(self) -> dict:
        return {
            "stages": [s.to_json() for s in self.stages],
            "objective_s": self.objective_s,
            "search_seconds": self.search_seconds,
            "num_cost_calls": self.num_cost_calls,
            "num_microbatches": self.num_microbatches,
            "schedule": self.schedule,
            "num_dp_runs": self.num_dp_runs,
        }

    @staticmethod
    def from_json(obj: dict, offload: str = "none") -> StagePlan:
        stages = tuple(Stage.from_json(s, offload) for s in obj["stages"])
        keys = ("objective_s", "search_seconds", "num_cost_calls", "num_microbatches", "schedule")
        return StagePlan(stages, *(obj[k] for k in keys), obj.get("num_dp_runs", 0))


def _specs_to_json(specs: Mapping[int, ShardingSpec], memo: dict | None = None) -> dict:
    """``specs`` as JSON; ``memo`` (spec -> its JSON) writes each distinct spec once
    (a stage's plan holds thousands of tensors in a few dozen specs)."""
    memo = {} if memo is None else memo
    out = {}
    for k, v in specs.items():
        found = memo.get(v)
        if found is None:
            found = memo[v] = v.to_json()
        out[str(k)] = found
    return out


def _specs_from_json(obj: dict) -> dict[int, ShardingSpec]:
    return {int(k): ShardingSpec.from_json(v) for k, v in obj.items()}


@dataclass(frozen=True)
class StageSpecs:
    """The intra-op plan of one stage, on the ids of the whole step's graph.

    ``tensor_specs``: node output id -> spec, for every equation of the stage's layers
    (forward, backward, update).  ``input_specs``: id -> spec of what the layers read from
    outside their own plan (parameters, optimizer state, batch leaves, activations and
    cotangents of other layers); where several layers read one tensor, the first one's
    spec.  ``operand_specs``: node index -> operand position -> the spec the plan reads it
    in, where that differs from the producer's.  All on the logical mesh ``logical_mesh``
    with axes :data:`LOGICAL_AXES`.
    """

    logical_mesh: Shape2
    tensor_specs: Mapping[int, ShardingSpec]
    input_specs: Mapping[int, ShardingSpec]
    operand_specs: Mapping[int, Mapping[int, ShardingSpec]]

    def to_json(self) -> dict:
        memo: dict = {}  # one JSON object per distinct spec, shared by its tensors
        return {
            "logical_mesh": list(self.logical_mesh),
            "tensor_specs": _specs_to_json(self.tensor_specs, memo),
            "input_specs": _specs_to_json(self.input_specs, memo),
            "operand_specs": {
                str(n): _specs_to_json(o, memo) for n, o in self.operand_specs.items()
            },
        }

    @staticmethod
    def from_json(obj: dict) -> StageSpecs:
        return StageSpecs(
            logical_mesh=tuple(obj["logical_mesh"]),
            tensor_specs=_specs_from_json(obj["tensor_specs"]),
            input_specs=_specs_from_json(obj["input_specs"]),
            operand_specs={int(n): _specs_from_json(o) for n, o in obj["operand_specs"].items()},
        )


@dataclass(frozen=True)
class InterPlan:
    """The chosen pipeline: stages, Alpa's latency objective and what the search cost."""

    model: str
    stages: tuple[Stage, ...]
    objective_s: float
    search_seconds: float
    phase_seconds: Mapping[str, float]  # "trace", "intra_op_ilps", "stage_dp"
    num_ilps: int
    num_cache_hits: int
    num_microbatches: int
    schedule: str
    method: str
    granularity: str
    stage_plan: StagePlan
    stage_specs: tuple[StageSpecs, ...] = ()  # each stage's intra-op plan
    # what lives in host memory (autoshard.inter.stage_offload.offload_summary); None: none
    offload: Mapping | None = None

    def to_json(self) -> dict:
        out = {
            "model": self.model,
            "stages": [s.to_json() for s in self.stages],
            "objective_s": self.objective_s,
            "search_seconds": self.search_seconds,
            "phase_seconds": dict(self.phase_seconds),
            "num_ilps": self.num_ilps,
            "num_cache_hits": self.num_cache_hits,
            "num_microbatches": self.num_microbatches,
            "schedule": self.schedule,
            "method": self.method,
            "granularity": self.granularity,
            "stage_plan": self.stage_plan.to_json(),
            "stage_specs": [s.to_json() for s in self.stage_specs],
        }
        if self.offload:
            out["offload"] = dict(self.offload)
        return out

    @staticmethod
    def from_json(obj: dict) -> InterPlan:
        # a file from before per-stage placements: every stage took the plan's
        offload = (obj.get("offload") or {}).get("offload", "none")
        return InterPlan(
            model=obj["model"],
            stages=tuple(Stage.from_json(s, offload) for s in obj["stages"]),
            objective_s=obj["objective_s"],
            search_seconds=obj["search_seconds"],
            phase_seconds=dict(obj["phase_seconds"]),
            num_ilps=obj["num_ilps"],
            num_cache_hits=obj["num_cache_hits"],
            num_microbatches=obj["num_microbatches"],
            schedule=obj["schedule"],
            method=obj["method"],
            granularity=obj["granularity"],
            stage_plan=StagePlan.from_json(obj["stage_plan"], offload),
            stage_specs=tuple(StageSpecs.from_json(s) for s in obj.get("stage_specs", ())),
            offload=obj.get("offload"),
        )

    def dumps(self) -> str:
        return json.dumps(self.to_json())

    @staticmethod
    def loads(text: str) -> InterPlan:
        return InterPlan.from_json(json.loads(text))
