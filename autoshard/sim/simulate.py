"""Simulate one training plan of a GPT preset on a cluster preset: step time, MFU, memory.

Takes a model preset (``gpt-350m`` ...), a cluster preset (``alpa-v100``, ``dgx-a100``,
``dgx-h100``, or a preset file), a GPU count and a plan; returns a frozen
:class:`SimulationReport` (step time, tokens/s, TFLOP/s per device, MFU, HFU, peak bytes
per device, an out-of-memory flag, the plan as a dict and a breakdown of the step that
adds up to ``step_time_s``).

Plans (``PLAN_FORMS``):

* ``megatron:TPxPPxDP`` -- one Megatron-LM grid, timed by
  :func:`autoshard.sim.megatron.simulate_megatron`; ``TP x PP x DP`` must equal ``gpus``.
* ``megatron`` -- every grid of :func:`megatron_grid` (TP a power of two up to the GPUs
  per node, PP dividing the layers, DP the rest, and micro-batch sizes that are powers of
  two dividing the per-replica batch, unless ``microbatch_size`` is given) is simulated;
  the report is the one with the most tokens/s among those that fit in memory (if none
  fits: the one that needs the least memory, flagged ``oom``).
* ``dp``, ``zero2``, ``zero3`` -- the Megatron grid ``1 x 1 x gpus`` (micro-batch searched
  as above) with the ZeRO stage's model-state division (:func:`formulas.model_state_bytes`)
  and communication: with ``m`` micro-batches per step, ZeRO-2 reduce-scatters each
  micro-batch's gradients (it keeps only its gradient shard), so ``m - 1`` reduce-scatters
  come on top of the step's all-reduce (= one reduce-scatter + one all-gather); ZeRO-3 also
  all-gathers the 16-bit weights before every forward and every backward, ``2 m - 1`` more
  all-gathers (``m = 1``: the familiar 1.5x of data parallel's volume; frameworks that
  gather again for a recomputed forward pay one more per micro-batch, not modelled). ZeRO
  runs the optimizer on the ``1/DP`` shard it owns, so its memory-bound time is divided by
  DP. ZeRO-3 holds one gathered block (the larger of a transformer layer and the
  embedding, 16-bit) on top of its shards. Nothing is overlapped with compute, as in
  :mod:`~autoshard.sim.megatron`.
* ``auto`` -- Alpa's search (:func:`autoshard.inter.search.auto_stage_plan`: intra-op ILPs with
  HiGHS on abstract shapes, then the stage DP) on the cluster preset. The step time *is*
  the search objective ``sum(t) + (m - 1) max(t)``, the memory the chosen stages' peak
  bytes; with ``recompute="none"`` the search gets the device's HBM as its budget.

One cost model behind search and simulation: the Megatron path and the ILPs behind
``auto`` both price collectives with the ring alpha-beta functions of :mod:`autoshard.intra.cost`
on meshes from :func:`autoshard.hardware.clusters.to_device_mesh` (the same link for the same
mesh axis), and both time compute with the device's GEMM table (each ``dot_general`` at
its per-device shard shape under the chosen strategy, :func:`autoshard.intra.strategies.
strategy_seconds`) and memory-bound work as bytes over HBM bandwidth. What still differs
is the program: the grid path models Megatron-LM's fused kernels, the auto path the traced
JAX step under the fusion model of :func:`autoshard.intra.problem.materialized_tensors` (its
attention softmax streams several fp32 buffers), so a block's elementwise time is higher
on the auto path (tests/test_sim_auto.py states the consequences).

Two programs for the Megatron grid (``program=``): ``"megatron-lm"`` (the default) times
Megatron-LM's own kernels as above -- the program the published measurements ran, and the
one :mod:`benchmarks.validate_megatron` checks. ``"traced"`` times the grid on the traced
JAX step, exactly as the search sees it: Megatron's stage split (the embedding with the
first blocks, the head with the last; ``layers / PP`` blocks each) on ``TP x DP``-device
sub-meshes viewed as the logical mesh ``(DP, TP)``, each stage's intra-op plan the ILP's on
that mesh (:class:`autoshard.inter.search.IntraStageCost`, the search's own stage costs), 1F1B
memory, and step time ``sum(t) + (m - 1) max(t)``. So ``auto`` and the grid are compared
on one program and one cost model: the search's plan is never slower than a grid point
priced this way at the same number of micro-batches (tests/test_sim_auto.py). The
micro-batch size is Megatron's (per data-parallel replica), searched over powers of two
when not given, as on the Megatron-LM program; each number of micro-batches is one trace.

Recompute under ``auto``: a plan dimension of the stage DP. Every stage candidate is
costed with no, selective and full recompute of its transformer blocks
(:func:`autoshard.inter.search.recompute_costs`: the forward or attention-core time of the chosen
intra-op plans added to the latency, the activations Korthikanti et al.'s scheme keeps);
with ``recompute="auto"`` (the default for ``plan="auto"``) the DP takes, per stage, the
fastest mode whose memory fits the device's HBM, and records it in ``plan["stages"]``;
``none`` / ``selective`` / ``full`` force one mode on every stage. If no plan fits, the
fastest is reported, flagged ``oom``.

MFU and HFU always come from :mod:`autoshard.sim.formulas` (model FLOPs, and model plus
recompute FLOPs), so ``hfu / mfu`` is exactly hardware over model FLOPs.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from autoshard.hardware.clusters import Cluster, load_cluster
from autoshard.hardware.gemm import GemmTable
from autoshard.hardware.mesh import to_device_mesh
from autoshard.intra.cost import all_gather_cost, reduce_scatter_cost
from autoshard.sim import formulas
from autoshard.sim.exact import ExactReport, check_exact_devices, exact_check
from autoshard.sim.megatron import (
    GRAD_ALLREDUCE_BYTES_PER_PARAM,
    MESH_AXES,
    NO_TIE_BREAKERS,
    GPTShape,
    MegatronConfig,
    SimResult,
    simulate_megatron,
)

PLAN_FORMS = ("auto", "dp", "zero2", "zero3", "megatron", "megatron:TPxPPxDP")
PROGRAMS = ("megatron-lm", "traced")  # what the Megatron grid is timed on
ZERO_STAGES = {"dp": 0, "zero2": 2, "zero3": 3}
DTYPES = ("bf16", "fp16", "fp32")
DEFAULT_AUTO_MICROBATCHES = 64  # the most micro-batches ``auto`` uses unless told
DEFAULT_ILP_TIME_LIMIT_S = 20.0
MODEL_OVERRIDES = ("seq_len", "vocab_size", "num_layers", "hidden")
_GRID = re.compile(r"^megatron:(\d+)x(\d+)x(\d+)$")


@dataclass(frozen=True)
class SimulationReport:
    """The predicted training step of one plan (see the module docstring)."""

    model: str
    cluster: str
    gpus: int
    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float  # hardware FLOPs (recompute included), as Megatron reports
    mfu: float
    hfu: float
    peak_bytes_per_device: float
    oom: bool
    plan: Mapping
    breakdown: Mapping[str, float]  # seconds per step; sums to step_time_s
    search_seconds: float = 0.0
    exact: ExactReport | None = None  # with simulate(..., exact=True)

    def to_json(self) -> dict:
        out = {
            "model": self.model,
            "cluster": self.cluster,
            "gpus": self.gpus,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "peak_bytes_per_device": self.peak_bytes_per_device,
            "oom": self.oom,
            "plan": _plain(self.plan),
            "breakdown": dict(self.breakdown),
            "search_seconds": self.search_seconds,
        }
        if self.exact is not None:
            out["exact"] = self.exact.to_json()
        return out


def _plain(value):
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class PlanRequest:
    """A parsed ``plan`` string: its kind and, for ``megatron:TPxPPxDP``, the grid."""

    kind: str  # auto, dp, zero2, zero3, megatron
    grid: tuple[int, int, int] | None = None  # (tp, pp, dp)


def parse_plan(text: str) -> PlanRequest:
    """``"megatron:8x4x2"`` -> PlanRequest("megatron", (8, 4, 2)); clear error otherwise."""
    plan = str(text).strip().lower()
    if plan in ("auto", "dp", "zero2", "zero3", "megatron"):
        return PlanRequest(plan)
    match = _GRID.match(plan)
    if match:
        grid = tuple(int(g) for g in match.groups())
        if min(grid) >= 1:
            return PlanRequest("megatron", grid)
    raise ValueError(
        f"plan {text!r} is not understood; use one of {', '.join(PLAN_FORMS)} "
        f"(TP, PP, DP positive integers, e.g. megatron:8x4x2)"
    )


def gpt_shape(model: str, **overrides) -> tuple[GPTShape, int]:
    """The :class:`GPTShape` of a GPT preset (with ``MODEL_OVERRIDES``) and its batch size."""
    from autoshard.models.gpt import GPT_PRESETS  # lazy: the models import jax

    if model not in GPT_PRESETS:
        raise ValueError(f"unknown model {model!r}; GPT presets: {', '.join(GPT_PRESETS)}")
    unknown = set(overrides) - set(MODEL_OVERRIDES)
    if unknown:
        raise ValueError(f"unknown override(s) {sorted(unknown)}; accepted: {MODEL_OVERRIDES}")
    cfg = GPT_PRESETS[model].replace(**overrides)
    shape = GPTShape(cfg.hidden, cfg.num_layers, cfg.num_heads, cfg.vocab_size, cfg.seq_len)
    return shape, cfg.batch_size


def _powers_of_two_dividing(n: int, cap: int | None = None) -> list[int]:
    out, p = [], 1
    while p <= n and (cap is None or p <= cap):
        if n % p == 0:
            out.append(p)
        p *= 2
    return out


def megatron_grid(
    shape: GPTShape,
    cluster: Cluster,
    global_batch: int,
    microbatch_size: int | None = None,
    recompute: str = "none",
    dtype: str | None = None,
    grid: tuple[int, int, int] | None = None,
) -> tuple[MegatronConfig, ...]:
    """The Megatron configurations ``plan="megatron"`` simulates on all of ``cluster``.

    TP: powers of two up to ``cluster.devices_per_node`` dividing heads and vocabulary;
    PP: divisors of the layers that divide the rest; DP: the rest. Micro-batch: powers of
    two dividing ``global_batch / DP`` (only ``microbatch_size`` if given). ``grid`` pins
    ``(tp, pp, dp)`` and leaves only the micro-batch to choose.
    """
    gpus = cluster.num_gpus
    if grid is not None:
        grids = [grid]
    else:
        grids = [
            (tp, pp, gpus // (tp * pp))
            for tp in _powers_of_two_dividing(gpus, cluster.devices_per_node)
            if shape.heads % tp == 0 and shape.vocab % tp == 0
            for pp in range(1, gpus // tp + 1)
            if (gpus // tp) % pp == 0 and shape.layers % pp == 0
        ]
    configs = []
    for tp, pp, dp in grids:
        if global_batch % dp:
            continue
        per_replica = global_batch // dp
        sizes = _powers_of_two_dividing(per_replica)
        if microbatch_size is not None:
            sizes = [microbatch_size] if per_replica % microbatch_size == 0 else []
        configs += [
            MegatronConfig(tp, pp, dp, b, global_batch, recompute, dtype=dtype) for b in sizes
        ]
    return tuple(configs)


# ----------------------------------------------------------------------------- the report


def _utilisation(
    shape: GPTShape, global_batch: int, recompute: str, step_s: float, gpus: int, peak: float
) -> dict:
    """tokens/s, hardware TFLOP/s per device, MFU and HFU of a step (formulas module)."""
    s, n_layers, h, v = shape.seq_len, shape.layers, shape.hidden, shape.vocab
    model_flops = formulas.model_flops_per_step(global_batch, s, n_layers, h, v)
    hw_flops = formulas.hardware_flops_per_step(global_batch, s, n_layers, h, v, recompute)
    return {
        "tokens_per_s": global_batch * s / step_s,
        "tflops_per_device": hw_flops / step_s / gpus / 1e12,
        "mfu": formulas.flops_utilization(model_flops, step_s, gpus, peak),
        "hfu": formulas.flops_utilization(hw_flops, step_s, gpus, peak),
    }


@dataclass(frozen=True)
class _Point:
    """One simulated Megatron/ZeRO configuration."""

    cfg: MegatronConfig
    step_time_s: float
    memory_bytes: float
    oom: bool
    breakdown: Mapping[str, float]


def zero_point(
    shape: GPTShape, cfg: MegatronConfig, cluster: Cluster, result: SimResult, zero_stage: int
) -> _Point:
    """A data-parallel Megatron result with ZeRO-``zero_stage`` memory and communication."""
    if zero_stage == 0:
        return _Point(
            cfg, result.step_time_s, result.memory_bytes_per_device, result.oom, result.breakdown
        )
    if cfg.tp != 1 or cfg.pp != 1:
        raise ValueError(f"ZeRO is modelled on a pure data-parallel grid, got {cfg}")
    h, n_layers, v = shape.hidden, shape.layers, shape.vocab
    params = formulas.gpt_params(h, n_layers, v, shape.seq_len) + 2 * h  # Megatron's count
    memory = (
        result.memory_bytes_per_device
        - formulas.model_state_bytes(params)
        + formulas.model_state_bytes(params, cfg.dp, zero_stage)
    )
    if zero_stage == 3:
        memory += 2 * max(12 * h * h + 13 * h, v * h)  # one gathered block, 16-bit
    mesh = to_device_mesh(cluster, (1, cfg.dp, 1), MESH_AXES, cfg.dtype)
    grad_bytes = params * GRAD_ALLREDUCE_BYTES_PER_PARAM
    m = cfg.num_microbatches
    breakdown = dict(result.breakdown)
    breakdown["optimizer"] /= cfg.dp
    breakdown["zero_reduce_scatter"] = (m - 1) * reduce_scatter_cost(
        mesh, "data", grad_bytes, NO_TIE_BREAKERS
    )
    if zero_stage == 3:
        breakdown["zero3_all_gather"] = (2 * m - 1) * all_gather_cost(
            mesh, "data", grad_bytes, NO_TIE_BREAKERS
        )
    return _Point(
        cfg,
        sum(breakdown.values()),
        memory,
        memory > cluster.device.hbm_bytes,
        MappingProxyType(breakdown),
    )


def _grid_points(shape: GPTShape, configs, cluster: Cluster, zero_stage: int) -> list[_Point]:
    """Every Megatron configuration simulated on ``cluster`` (with ZeRO's memory and
    communication for ``zero_stage`` > 0)."""
    table = GemmTable.load(cluster.device.gemm_table) if cluster.device.gemm_table else None
    return [
        zero_point(shape, cfg, cluster, simulate_megatron(shape, cfg, cluster, table), zero_stage)
        for cfg in configs
    ]


def _best(points: list[_Point]) -> _Point:
    """Most tokens/s among points that fit; if none fits, the one needing least memory."""
    fitting = [p for p in points if not p.oom]
    if fitting:
        return min(fitting, key=lambda p: p.step_time_s)
    return min(points, key=lambda p: p.memory_bytes)


def _check_dtype(dtype: str | None, cluster: Cluster) -> str:
    dtype = dtype or cluster.device.default_dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} (or None), got {dtype!r}")
    cluster.device.peak_flops_for(dtype)  # raises, naming the dtypes the device has
    return dtype


def simulate(
    model: str,
    cluster: str,
    gpus: int,
    plan: str = "megatron",
    microbatch_size: int | None = None,
    global_batch: int | None = None,
    recompute: str | None = None,
    dtype: str | None = None,
    *,
    ilp_time_limit_s: float = DEFAULT_ILP_TIME_LIMIT_S,
    exact: bool = False,
    program: str = "megatron-lm",
    **overrides,
) -> SimulationReport:
    """Simulate ``plan`` for GPT preset ``model`` on ``gpus`` GPUs of cluster preset ``cluster``.

    ``global_batch`` defaults to the preset's batch size; ``dtype`` (``bf16``, ``fp16``,
    ``fp32``) to the device's 16-bit dtype (fp16 on V100); ``overrides``: any of
    ``MODEL_OVERRIDES``. ``ilp_time_limit_s`` bounds each ILP of ``plan="auto"``.
    ``recompute``: ``none``, ``selective``, ``full``, or ``auto`` (the stage DP chooses per
    stage; only with ``plan="auto"``, and its default there; ``none`` elsewhere).
    ``exact``: also compile the plan on ``gpus`` fake CPU devices and put compiled vs
    predicted memory and collectives in ``report.exact`` (:func:`autoshard.sim.exact.
    exact_check`; pipelines get ``available=False``). Raises
    ``ValueError`` for an unknown model, preset or plan, a GPU count the cluster cannot
    give, a grid whose product is not ``gpus``, sizes that do not divide, or ``exact`` with
    more than ``MAX_EXACT_DEVICES`` GPUs or fewer JAX CPU devices than ``gpus``.
    ``program``: what a Megatron grid is timed on (``PROGRAMS``; module docstring).
    """
    report = _simulate(
        model, cluster, gpus, plan, microbatch_size, global_batch, recompute, dtype,
        ilp_time_limit_s, exact, overrides, program,
    )  # fmt: skip
    if not exact:
        return report
    checked = exact_check(report, cluster, time_limit_s=ilp_time_limit_s, **overrides)
    return dataclasses.replace(report, exact=checked)


def _simulate(
    model, cluster, gpus, plan, microbatch_size, global_batch, recompute, dtype,
    ilp_time_limit_s, exact, overrides, program="megatron-lm",
) -> SimulationReport:  # fmt: skip
    request = parse_plan(plan)
    if program not in PROGRAMS:
        raise ValueError(f"program must be one of {PROGRAMS}, got {program!r}")
    if program == "traced" and request.kind != "megatron":
        raise ValueError(
            f"program='traced' times Megatron grids (plan megatron or megatron:TPxPPxDP) on "
            f"the traced step; plan {plan!r} is timed "
            + ("on it already" if request.kind == "auto" else "on Megatron-LM's program")
        )
    if recompute is None:
        recompute = "auto" if request.kind == "auto" else "none"
    if recompute == "auto" and request.kind != "auto":
        raise ValueError(
            f"recompute='auto' lets the stage DP choose and needs plan='auto'; for plan "
            f"{plan!r} use one of {formulas.RECOMPUTE_MODES}"
        )
    if recompute not in (*formulas.RECOMPUTE_MODES, "auto"):
        raise ValueError(
            f"recompute must be one of {(*formulas.RECOMPUTE_MODES, 'auto')}, got {recompute!r}"
        )
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a positive int, got {gpus!r}")
    if exact:
        check_exact_devices(gpus)
    if request.grid is not None and request.grid[0] * request.grid[1] * request.grid[2] != gpus:
        tp, pp, dp = request.grid
        raise ValueError(
            f"plan {plan} needs TP x PP x DP = {tp * pp * dp} GPUs but gpus={gpus}; make the "
            f"product equal gpus (e.g. megatron:{tp}x{pp}x{max(gpus // (tp * pp), 1)} if that "
            f"divides)"
        )
    shape, preset_batch = gpt_shape(model, **overrides)
    the_cluster = load_cluster(cluster, gpus)
    dtype = _check_dtype(dtype, the_cluster)
    batch = preset_batch if global_batch is None else global_batch
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"global_batch must be a positive int, got {batch!r}")
    if microbatch_size is not None and (
        isinstance(microbatch_size, bool)
        or not isinstance(microbatch_size, int)
        or microbatch_size < 1
    ):
        raise ValueError(f"microbatch_size must be a positive int, got {microbatch_size!r}")
    peak = the_cluster.device.peak_flops_for(dtype)
    if request.kind == "auto":
        return _simulate_auto(
            model, shape, the_cluster, batch, microbatch_size, recompute, dtype, peak,
            ilp_time_limit_s, overrides,
        )  # fmt: skip

    if program == "traced":
        return _simulate_traced_grid(
            model, shape, the_cluster, batch, microbatch_size, request.grid, recompute,
            dtype, peak, ilp_time_limit_s, overrides,
        )  # fmt: skip
    t0 = time.perf_counter()
    zero_stage = ZERO_STAGES.get(request.kind, 0)
    grid = request.grid if request.kind == "megatron" else (1, 1, gpus)
    configs = megatron_grid(shape, the_cluster, batch, microbatch_size, recompute, dtype, grid)
    if not configs:
        raise ValueError(
            f"no {request.kind} configuration of {model} fits {gpus} GPUs with global batch "
            f"{batch}"
            + (f" and micro-batch {microbatch_size}" if microbatch_size else "")
            + ": the batch must divide by DP x micro-batch, heads and vocabulary by TP, "
            "layers by PP"
        )
    points = _grid_points(shape, configs, the_cluster, zero_stage)
    best = _best(points)
    cfg = best.cfg
    plan_dict = {
        "kind": request.kind,
        "tp": cfg.tp,
        "pp": cfg.pp,
        "dp": cfg.dp,
        "microbatch_size": cfg.micro_batch,
        "num_microbatches": cfg.num_microbatches,
        "global_batch": batch,
        "recompute": recompute,
        "dtype": dtype,
        "zero_stage": zero_stage,
        "searched_grid": request.kind == "megatron" and request.grid is None,
        "candidates_evaluated": len(points),
    }
    return SimulationReport(
        model=model,
        cluster=the_cluster.name,
        gpus=gpus,
        step_time_s=best.step_time_s,
        **_utilisation(shape, batch, recompute, best.step_time_s, gpus, peak),
        peak_bytes_per_device=best.memory_bytes,
        oom=best.oom,
        plan=MappingProxyType(plan_dict),
        breakdown=best.breakdown,
        search_seconds=time.perf_counter() - t0,
    )


# ----------------------------------------------------------------------------- auto


def _default_microbatches(
    batch: int, shape: GPTShape | None = None, cluster: Cluster | None = None, dtype=None
) -> int:
    """Micro-batches of ``plan="auto"`` when none are given: the largest divisor of the
    batch up to ``DEFAULT_AUTO_MICROBATCHES``; but if no Megatron layout fits the HBM at
    that micro-batch size (full recompute), as many as the fastest Megatron layout that
    fits uses -- smaller micro-batches, so that the search has plans that fit. The grid
    takes about 0.1 s to simulate; the search itself would take a minute per count."""
    m = max(d for d in range(1, min(batch, DEFAULT_AUTO_MICROBATCHES) + 1) if batch % d == 0)
    if shape is None or cluster is None:
        return m
    configs = megatron_grid(shape, cluster, batch, None, "full", dtype)
    fitting = [p for p in _grid_points(shape, configs, cluster, 0) if not p.oom]
    # Megatron's micro-batch is per data-parallel replica; ours is the global micro-batch
    if not fitting or any(p.cfg.micro_batch == batch // m for p in fitting):
        return m
    return max(m, _best(fitting).cfg.num_microbatches)


def _hardware_flops(shape: GPTShape, batch: int, stages, layers_per_stage) -> int:
    """Model FLOPs plus what each stage's recompute mode adds for its transformer blocks."""
    s, n_layers, h, v = shape.seq_len, shape.layers, shape.hidden, shape.vocab
    flops = formulas.model_flops_per_step(batch, s, n_layers, h, v)
    for stage, blocks in zip(stages, layers_per_stage, strict=True):
        flops += formulas.recompute_flops_per_step(batch, s, blocks, h, stage.recompute)
    return flops


def _simulate_auto(
    model, shape, cluster, batch, microbatch_size, recompute, dtype, peak, time_limit, overrides
) -> SimulationReport:
    from autoshard.inter.search import search_stages  # lazy: traces with jax

    if microbatch_size is None:
        m = _default_microbatches(batch, shape, cluster, dtype)
    elif batch % microbatch_size:
        raise ValueError(
            f"microbatch_size={microbatch_size} does not divide the global batch {batch}"
        )
    else:
        m = batch // microbatch_size
    b = batch // m
    hosts, per_host = cluster.num_nodes, cluster.devices_per_node
    t0 = time.perf_counter()
    # one set of intra-op ILPs, shared by the search under the HBM budget and, when
    # nothing fits, by the unconstrained search that reports the fastest plan as OOM
    cost = search_stage_cost(model, cluster, batch, m, dtype, time_limit, overrides)
    traced_graph = cost.graph
    t_trace = time.perf_counter()
    modes = formulas.RECOMPUTE_MODES if recompute == "auto" else (recompute,)
    kwargs = dict(cost=cost, recompute_modes=modes, model=model)
    hbm = cluster.device.hbm_bytes
    try:
        inter = search_stages(traced_graph, hosts, per_host, m, memory_budget_bytes=hbm, **kwargs)
    except ValueError as err:
        if "budget" not in str(err):
            raise
        inter = search_stages(traced_graph, hosts, per_host, m, **kwargs)
    total = time.perf_counter() - t0
    phases = {  # over both searches when the fallback ran (the ILPs are solved once)
        "trace": t_trace - t0,  # trace and stage-cost set-up
        "intra_op_ilps": cost.seconds,
        "stage_dp": max(total - (t_trace - t0) - cost.seconds, 0.0),
    }
    inter = dataclasses.replace(inter, search_seconds=total, phase_seconds=phases)

    last = len(traced_graph.layers) - 1
    blocks = [
        sum(1 for i in range(st.start_layer, st.end_layer) if 0 < i < last) for st in inter.stages
    ]
    stages = [
        {
            "layers": [st.layers[0], st.layers[-1]],
            "num_layers": len(st.layers),
            "submesh": list(st.submesh),
            "logical_mesh_dp_tp": list(st.logical_mesh),
            "recompute": st.recompute,
            "latency_s": st.latency_s,
            "peak_bytes": st.peak_bytes,
            "microbatches_in_flight": assigned.microbatches_in_flight,
        }
        for st, assigned in zip(inter.stages, inter.stage_plan.stages, strict=True)
    ]
    step = inter.objective_s
    fill = sum(st.latency_s for st in inter.stages)
    logical = {tuple(st.logical_mesh) for st in inter.stages}
    dp, tp = next(iter(logical)) if len(logical) == 1 else (None, None)
    plan_dict = {
        "kind": "auto",
        "tp": tp,
        "pp": len(inter.stages),
        "dp": dp,
        "microbatch_size": b,
        "num_microbatches": m,
        "global_batch": batch,
        "recompute": recompute,
        "dtype": dtype,
        "zero_stage": None,
        "stages": stages,
        "search_objective_s": inter.objective_s,
        "num_ilps": inter.num_ilps,
        "phase_seconds": dict(inter.phase_seconds),
    }
    peak_bytes = max(st.peak_bytes for st in inter.stages)
    gpus = cluster.num_gpus
    s, n_layers, h, v = shape.seq_len, shape.layers, shape.hidden, shape.vocab
    model_flops = formulas.model_flops_per_step(batch, s, n_layers, h, v)
    hw_flops = _hardware_flops(shape, batch, inter.stages, blocks)
    return SimulationReport(
        model=model,
        cluster=cluster.name,
        gpus=gpus,
        step_time_s=step,
        tokens_per_s=batch * s / step,
        tflops_per_device=hw_flops / step / gpus / 1e12,
        mfu=formulas.flops_utilization(model_flops, step, gpus, peak),
        hfu=formulas.flops_utilization(hw_flops, step, gpus, peak),
        peak_bytes_per_device=peak_bytes,
        oom=peak_bytes > hbm,
        plan=MappingProxyType(plan_dict),
        breakdown=MappingProxyType({"pipeline_fill": fill, "pipeline_steady": step - fill}),
        search_seconds=inter.search_seconds,
    )


# ----------------------------------------------------------------------------- grid, traced


_TRACED_COSTS: dict = {}  # the last few IntraStageCosts: their ILPs are reused


def _traced_stage_cost(model, cluster, batch, m, dtype, time_limit, overrides):
    """The search's IntraStageCost of the traced step of ``m`` micro-batches on
    ``cluster``; kept for the next call with the same arguments (the ILPs of each logical
    mesh are solved once per process)."""
    key = (model, repr(cluster), batch, m, dtype, time_limit, tuple(sorted(overrides.items())))
    if key not in _TRACED_COSTS:
        if len(_TRACED_COSTS) >= 4:
            _TRACED_COSTS.pop(next(iter(_TRACED_COSTS)))
        _TRACED_COSTS[key] = search_stage_cost(
            model, cluster, batch, m, dtype, time_limit, overrides
        )
    return _TRACED_COSTS[key]


def search_stage_cost(model, cluster, batch, m, dtype, time_limit, overrides):
    """The stage costs ``plan="auto"``'s search uses: intra-op ILPs (HiGHS) over the
    traced step of ``m`` micro-batches, priced at ``dtype``'s peak and GEMM efficiency on
    ``cluster`` (an :class:`autoshard.inter.search.IntraStageCost`; its ``graph`` is the step)."""
    from autoshard.inter.search import (  # lazy: traces with jax
        IntraStageCost,
        cluster_for,
        logical_mesh_costs,
        trace_microbatch,
    )

    search_cluster = dataclasses.replace(
        cluster, device=dataclasses.replace(cluster.device, default_dtype=dtype)
    )
    traced = trace_microbatch(
        model, m, "adamw", batch_size=batch, dtype="float32" if dtype == "fp32" else "bfloat16",
        **overrides,
    )  # fmt: skip
    mesh_for = logical_mesh_costs(
        cluster_for(search_cluster, cluster.num_nodes, cluster.devices_per_node)
    )
    return IntraStageCost(
        traced.graph, mesh_for, solver="highs", time_limit_s=time_limit, num_microbatches=m
    )


def megatron_stages(num_blocks: int, pp: int) -> tuple[tuple[int, int], ...]:
    """Megatron's layer ranges over the traced layers (0: embedding, ``num_blocks + 1``:
    head): ``num_blocks / pp`` blocks per stage, the embedding in the first, the head in
    the last."""
    if num_blocks % pp:
        raise ValueError(f"PP={pp} must divide the {num_blocks} transformer blocks")
    per = num_blocks // pp
    return tuple(
        (0 if i == 0 else 1 + i * per, num_blocks + 2 if i == pp - 1 else 1 + (i + 1) * per)
        for i in range(pp)
    )


def _grid_submesh(devices: int, cluster: Cluster) -> tuple[int, int]:
    per_host = cluster.devices_per_node
    return (devices // per_host, per_host) if devices >= per_host else (1, devices)


def _simulate_traced_grid(
    model, shape, cluster, batch, microbatch_size, grid, recompute, dtype, peak, time_limit,
    overrides,
) -> SimulationReport:  # fmt: skip
    from autoshard.inter.stages import microbatches_in_flight, pipeline_objective

    gpus = cluster.num_gpus
    if grid is not None and shape.layers % grid[1]:
        raise ValueError(f"PP={grid[1]} must divide the {shape.layers} transformer blocks")
    configs = megatron_grid(shape, cluster, batch, microbatch_size, recompute, dtype, grid)
    if not configs:
        raise ValueError(
            f"no Megatron grid of {model} on {gpus} GPUs takes the global batch {batch}"
            + (f" in micro-batches of {microbatch_size} per replica" if microbatch_size else "")
            + ": the batch must divide by DP x micro-batch, heads and vocabulary by TP, "
            "layers by PP"
        )
    t0 = time.perf_counter()
    hbm = cluster.device.hbm_bytes
    points, stages = [], {}
    # one trace (and one set of stage ILPs) per number of micro-batches
    for cfg in sorted(configs, key=lambda c: (c.num_microbatches, c.tp, c.pp, c.dp)):
        m = cfg.num_microbatches
        cost = _traced_stage_cost(model, cluster, batch, m, dtype, time_limit, overrides)
        submesh = _grid_submesh(cfg.tp * cfg.dp, cluster)
        ranges = megatron_stages(shape.layers, cfg.pp)
        stage_costs = [cost(a, b, submesh, (cfg.dp, cfg.tp), recompute) for a, b in ranges]
        latencies = [c.latency_s for c in stage_costs]
        memory = [
            c.memory_bytes(microbatches_in_flight(i, cfg.pp, m, "1f1b"))
            for i, c in enumerate(stage_costs)
        ]
        step = pipeline_objective(latencies, m)
        fill = sum(latencies)
        breakdown = MappingProxyType({"pipeline_fill": fill, "pipeline_steady": step - fill})
        points.append(_Point(cfg, step, max(memory), max(memory) > hbm, breakdown))
        names = cost.graph.layers
        stages[cfg] = [
            {
                "layers": [names[a], names[b - 1]],
                "num_layers": b - a,
                "submesh": list(submesh),
                "logical_mesh_dp_tp": [cfg.dp, cfg.tp],
                "recompute": recompute,
                "latency_s": lat,
                "peak_bytes": mem,
            }
            for (a, b), lat, mem in zip(ranges, latencies, memory, strict=True)
        ]
    best = _best(points)
    cfg = best.cfg
    plan_dict = {
        "kind": "megatron",
        "program": "traced",
        "tp": cfg.tp,
        "pp": cfg.pp,
        "dp": cfg.dp,
        "microbatch_size": cfg.micro_batch,
        "num_microbatches": cfg.num_microbatches,
        "global_batch": batch,
        "recompute": recompute,
        "dtype": dtype,
        "zero_stage": 0,
        "searched_grid": grid is None,
        "candidates_evaluated": len(points),
        "stages": stages[cfg],
        "grid_points": [
            {
                "tp": p.cfg.tp,
                "pp": p.cfg.pp,
                "dp": p.cfg.dp,
                "num_microbatches": p.cfg.num_microbatches,
                "step_time_s": p.step_time_s,
                "peak_bytes": p.memory_bytes,
            }
            for p in points
        ],
    }
    return SimulationReport(
        model=model,
        cluster=cluster.name,
        gpus=gpus,
        step_time_s=best.step_time_s,
        **_utilisation(shape, batch, recompute, best.step_time_s, gpus, peak),
        peak_bytes_per_device=best.memory_bytes,
        oom=best.oom,
        plan=MappingProxyType(plan_dict),
        breakdown=best.breakdown,
        search_seconds=time.perf_counter() - t0,
    )


__all__ = [
    "PROGRAMS",
    "megatron_stages",
    "PLAN_FORMS",
    "PlanRequest",
    "SimulationReport",
    "gpt_shape",
    "megatron_grid",
    "parse_plan",
    "simulate",
    "zero_point",
]
