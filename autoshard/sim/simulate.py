"""Simulate one training plan of a GPT preset on a cluster preset: step time, MFU, memory.

Takes a model preset (``gpt-350m`` ...), a cluster preset (``alpa-v100``, ``dgx-a100``,
``dgx-h100``, or a preset file), a GPU count and a plan; returns a frozen
:class:`~autoshard.sim.report.SimulationReport` (step time, tokens/s, TFLOP/s per device,
MFU, HFU, peak bytes per device, an out-of-memory flag, the plan as a dict and a breakdown
of the step that adds up to ``step_time_s``). This module checks the request and sends it
to the module that prices it.

Plans (``PLAN_FORMS``):

* ``megatron:TPxPPxDP`` -- one Megatron-LM grid, timed by
  :func:`autoshard.sim.megatron.simulate_megatron`; ``TP x PP x DP`` must equal ``gpus``.
* ``megatron`` -- every grid of :func:`autoshard.sim.grid.megatron_grid` is simulated; the
  report is the one with the most tokens/s among those that fit in memory (if none fits:
  the one that needs the least memory, flagged ``oom``).
* ``dp``, ``zero2``, ``zero3`` -- the Megatron grid ``1 x 1 x gpus`` with the ZeRO stage's
  model-state division and communication (:mod:`autoshard.sim.grid`).
* ``auto`` -- Alpa's search (:func:`autoshard.api_pipeline.auto_stage_plan`: intra-op ILPs with
  HiGHS on abstract shapes, then the stage DP) on the cluster preset
  (:mod:`autoshard.sim.auto`, which also says how recompute is chosen).

One cost model behind search and simulation: the Megatron path and the ILPs behind
``auto`` both price collectives with the ring alpha-beta functions of :mod:`autoshard.intra.cost.resharding`
on meshes from :func:`autoshard.hardware.clusters.to_device_mesh` (the same link for the same
mesh axis), and both time compute with the device's GEMM table (each ``dot_general`` at
its per-device shard shape under the chosen strategy, :func:`autoshard.intra.rules.strategies.
strategy_seconds`) and memory-bound work as bytes over HBM bandwidth. What still differs
is the program: the grid path models Megatron-LM's fused kernels, the auto path the traced
JAX step under the fusion model of :func:`autoshard.intra.memory.materialized.materialized_tensors` (its
attention softmax streams several fp32 buffers), so a block's elementwise time is higher
on the auto path (tests/test_sim_auto.py states the consequences).

Three programs for the Megatron grid (``program=``): ``"megatron-lm"`` (the default) times
Megatron-LM's own 2021 kernels as above -- the program the published measurements ran, and
the one :mod:`benchmarks.validate_megatron` checks. ``"megatron-lm-flash"`` is today's
Megatron-LM with flash attention (``--use-flash-attn``, Transformer Engine): the same model
with the attention core timed from the device's attention table
(:class:`~autoshard.sim.megatron.MegatronConfig` ``attention="flash"``; dgx-a100 and
dgx-h100, not the V100 presets), the fair baseline for autoshard's fused step. ``"traced"``
times the grid on the traced JAX step, exactly as the search sees it
(:mod:`autoshard.sim.traced`).

MFU and HFU always come from :mod:`autoshard.sim.formulas` (model FLOPs, and model plus
recompute FLOPs), so ``hfu / mfu`` is exactly hardware over model FLOPs.

Other model families: :func:`gpt_shape` is the one place a GPT preset name becomes the
shape the closed forms read. GPT-MoE presets are priced by ``plan="auto"`` only
(:func:`traced_only_model`: the search needs no closed form; FLOPs for MFU/HFU come from
the traced step, :func:`autoshard.sim.auto._traced_flops`; micro-batches hold whole expert
groups, :func:`moe_microbatches`). Wide-ResNet presets likewise (``plan="auto"`` only,
FLOPs from the traced step; ``tokens_per_s`` counts images: one "token" per image). The
MLP is refused with a ``ValueError`` that says so: the Megatron grid model
(:mod:`~autoshard.sim.megatron`) is GPT-only.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from autoshard.hardware.clusters import Cluster, load_cluster
from autoshard.sim import formulas
from autoshard.sim.auto import (
    MICROBATCH_SEARCH,
    _default_microbatches,
    microbatch_candidates,
    search_microbatches,
    simulate_auto,
)
from autoshard.sim.exact import check_exact_devices, exact_check
from autoshard.sim.grid import Schedule, simulate_grid
from autoshard.sim.megatron import GPTShape
from autoshard.sim.report import SimulationReport
from autoshard.sim.traced import simulate_traced_grid

PLAN_FORMS = ("auto", "dp", "zero2", "zero3", "megatron", "megatron:TPxPPxDP")
PROGRAMS = ("megatron-lm", "megatron-lm-flash", "traced")  # what the Megatron grid is timed on
MEGATRON_LM_PROGRAMS = ("megatron-lm", "megatron-lm-flash")
DTYPES = ("bf16", "fp16", "fp32")
DEFAULT_ILP_TIME_LIMIT_S = 20.0
MODEL_OVERRIDES = (
    "seq_len",
    "vocab_size",
    "num_layers",
    "hidden",
    "num_heads",
    "num_experts",
    "attention",
)
_GRID = re.compile(r"^megatron:(\d+)x(\d+)x(\d+)$")


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


def _check_overrides(overrides: dict) -> None:
    unknown = set(overrides) - set(MODEL_OVERRIDES)
    if unknown:
        raise ValueError(f"unknown override(s) {sorted(unknown)}; accepted: {MODEL_OVERRIDES}")


def gpt_shape(model: str, **overrides) -> tuple[GPTShape, int]:
    """The :class:`GPTShape` of a GPT preset (with ``MODEL_OVERRIDES``) and its batch size."""
    from autoshard.models import model_names  # lazy: the models import jax
    from autoshard.models.gpt import GPT_PRESETS
    from autoshard.models.moe import MOE_PRESETS

    if model not in GPT_PRESETS:
        if model in model_names():  # a workload autoshard knows, but not a GPT
            moe = " with plan='auto'" if model in MOE_PRESETS else ""
            raise ValueError(
                f"the simulator prices GPT models, and GPT-MoE and Wide-ResNet models with "
                f"plan='auto' only; "
                f"{model!r} is not a GPT{moe} (its step has no Megatron-LM closed form here). "
                f"Plan it on devices you have: `autoshard plan --model {model}`; or simulate "
                f"a GPT preset: {', '.join(GPT_PRESETS)}"
                + (f", or {model} with --plan auto" if moe else "")
            )
        raise ValueError(f"unknown model {model!r}; GPT presets: {', '.join(GPT_PRESETS)}")
    _check_overrides(overrides)
    if "num_experts" in overrides:
        raise ValueError(
            f"num_experts is for the GPT-MoE presets ({', '.join(MOE_PRESETS)}, with "
            f"plan='auto'); {model!r} is a dense GPT"
        )
    cfg = GPT_PRESETS[model].replace(**overrides)
    return shape_of(cfg), cfg.batch_size


def shape_of(cfg) -> GPTShape:
    """The :class:`GPTShape` of a GPT config (a preset's, overrides applied)."""
    return GPTShape(cfg.hidden, cfg.num_layers, cfg.num_heads, cfg.vocab_size, cfg.seq_len)


def traced_only_model(model: str, plan_kind: str, overrides: dict, exact: bool):
    """The config of a GPT-MoE (:class:`~autoshard.models.moe.MoEConfig`) or Wide-ResNet
    preset, which only ``plan="auto"`` prices (the search on its traced step; the
    baselines' closed forms are Megatron-LM's GPT); None for any other model. Raises,
    saying what works, for such a preset with another plan, ``exact``, or model overrides
    (a GPT-MoE takes any of ``MODEL_OVERRIDES``, ``num_experts`` included; a Wide-ResNet
    none). The config returned has the overrides applied."""
    from autoshard.models.moe import MOE_PRESETS  # lazy: the models import jax
    from autoshard.models.wresnet import WRESNET_PRESETS

    if model in WRESNET_PRESETS:
        family, presets = "Wide-ResNet", WRESNET_PRESETS
    elif model in MOE_PRESETS:
        family, presets = "GPT-MoE", MOE_PRESETS
    else:
        return None
    problems = []
    if plan_kind != "auto":
        problems.append(
            "only plan='auto' prices it (the search on its traced step); Megatron grids, DP "
            "and ZeRO are priced on Megatron-LM's dense GPT program"
        )
    _check_overrides(overrides)
    if overrides and family == "Wide-ResNet":
        problems.append(f"model overrides {sorted(overrides)} are for the GPT and GPT-MoE presets")
    if exact:
        problems.append("exact mode compiles GPT plans only")
    if problems:
        raise ValueError(f"{model} is a {family}: " + "; ".join(problems) + " -- use --plan auto")
    return presets[model].replace(**overrides)


def moe_microbatch_counts(cfg, batch: int) -> list[int]:
    """The micro-batch counts of a GPT-MoE's global ``batch`` whose micro-batch holds whole
    expert groups (its tokens a multiple of ``expert_group_size``), ascending."""
    group, seq = cfg.expert_group_size, cfg.seq_len
    return [d for d in range(1, batch + 1) if batch % d == 0 and (batch // d * seq) % group == 0]


def moe_microbatches(cfg, batch: int, requested: int | None) -> int:
    """Micro-batches per step for a GPT-MoE: ``requested``, or the most (up to
    ``DEFAULT_AUTO_MICROBATCHES``) whose micro-batch holds whole expert groups (its tokens
    a multiple of ``expert_group_size``, which the model's gating needs)."""
    from autoshard.sim.auto import DEFAULT_AUTO_MICROBATCHES

    group, seq = cfg.expert_group_size, cfg.seq_len
    fits = moe_microbatch_counts(cfg, batch)
    if requested is not None:
        if requested not in fits:
            raise ValueError(
                f"num_microbatches={requested}: each micro-batch must divide the global batch "
                f"{batch} and hold whole expert groups of {group} tokens ({seq} per sequence); "
                f"use one of {fits or 'none: raise the global batch'}"
            )
        return requested
    small = [d for d in fits if d <= DEFAULT_AUTO_MICROBATCHES]
    if not small:
        raise ValueError(
            f"global batch {batch} x {seq} tokens holds no whole expert group of {group} "
            f"tokens; use a global batch that is a multiple of {group // math.gcd(group, seq)}"
        )
    return max(small)


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
    num_microbatches: int | str | tuple | None = None,
    sequence_parallel: bool = False,
    virtual_stages: int = 1,
    optimizer: str = "adamw",
    progress=None,
    offload: str | None = None,
    grad_reduce: str = "microbatch",
    **overrides,
) -> SimulationReport:
    """Simulate ``plan`` for GPT preset ``model`` on ``gpus`` GPUs of cluster preset ``cluster``.

    ``global_batch`` defaults to the preset's batch size; ``dtype`` (``bf16``, ``fp16``,
    ``fp32``) to the device's 16-bit dtype (fp16 on V100); ``overrides``: any of
    ``MODEL_OVERRIDES`` (``attention``, ``"fused"`` by default or ``"unfused"``: the traced
    step's, with ``program="traced"`` or ``plan="auto"``). ``ilp_time_limit_s`` bounds each ILP of ``plan="auto"``;
    ``progress`` (:class:`autoshard.inter.progress.Progress`) is where its phases report.
    ``recompute``: ``none``, ``selective``, ``full``, or ``auto`` (the stage DP chooses per
    stage; only with ``plan="auto"``, and its default there; ``none`` elsewhere).
    ``exact``: also compile the plan on ``gpus`` fake CPU devices and put compiled vs
    predicted memory and collectives in ``report.exact`` (:func:`autoshard.sim.exact.
    exact_check`; pipelines get ``available=False``). Raises
    ``ValueError`` for an unknown model, preset or plan, a GPU count the cluster cannot
    give, a grid whose product is not ``gpus``, sizes that do not divide, or ``exact`` with
    more than ``MAX_EXACT_DEVICES`` GPUs or fewer JAX CPU devices than ``gpus``.
    ``program``: what a Megatron grid is timed on (``PROGRAMS``; module docstring).

    Micro-batches, one meaning per argument: ``microbatch_size`` is sequences per
    micro-batch *per data-parallel replica* (Megatron-LM's ``--micro-batch-size``; grid
    plans only: ``plan="auto"`` chooses a DP degree per stage, so it takes
    ``num_microbatches``); ``num_microbatches`` is micro-batches per step, on every plan.
    Give at most one; neither: searched (grids) or chosen (``auto``). ``plan="auto"``
    also searches the count: ``num_microbatches="search"`` runs the whole search at each
    of the default count, a quarter and half of it, twice and four times it (those that
    are whole and divide the global batch; for a GPT-MoE, whose micro-batches hold whole
    expert groups);
    a tuple or list of counts searches those, and ``"search"`` among them adds the
    default candidates (``("search", 256)``: those and 256). The fastest report that fits
    the HBM wins (none fits: the least peak memory); ``plan["microbatch_search"]`` lists
    every candidate's step time, peak memory and whether it fit
    (:func:`autoshard.sim.auto.search_microbatches`); ``search_seconds`` is their sum.
    ``sequence_parallel`` and ``virtual_stages`` (interleaved 1F1B, Megatron-LM's
    ``--num-layers-per-virtual-pipeline-stage`` = layers / (PP x v)) are modelled on
    Megatron-LM's program only. ``optimizer`` (``OPTIMIZERS``): the optimizer of the traced
    step, for ``plan="auto"`` only (the grids' memory model is mixed-precision Adam);
    Alpa's GPT-MoE benchmark trains with ``adafactor``. ``offload`` (``plan="auto"`` only;
    :mod:`autoshard.intra.offload.placement`, docs/offload.md): ``None``/``"none"``, a placement
    (``"optimizer"``, ``"optimizer,master"``, ``"optimizer,master,gradients"``) every stage
    takes, or ``"auto"``: each stage chooses its placement (none or one of those) with its
    logical mesh and recompute mode, the fastest that fits its HBM, within the host's
    memory (:mod:`autoshard.inter.stage_offload`); ``plan["offload"]`` says what lives
    where, per stage (absent when no stage offloads). ``grad_reduce``
    (:data:`autoshard.inter.stages.GRAD_REDUCE_CHOICES`; the traced step only: ``plan="auto"``
    or ``program="traced"``): where a stage with several data-parallel replicas reduces
    its gradients, ``"microbatch"`` (every micro-batch: the pipeline runtime's default),
    ``"step"`` (once per step, as Megatron-LM does: replicas of a plan over ``model``,
    :meth:`autoshard.inter.stage_cost.IntraStageCost.replica_range_cost`) or ``"auto"``
    (each stage chooses); each stage's ``grad_reduce`` in ``plan["stages"]`` says which.
    """
    from autoshard.models import OPTIMIZERS  # lazy: the models import jax

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if optimizer != "adamw" and parse_plan(plan).kind != "auto":
        raise ValueError(
            f"optimizer={optimizer!r} is priced on the traced step, by plan='auto' only; plan "
            f"{plan!r} models mixed-precision Adam (use optimizer='adamw')"
        )
    if (
        "attention" in overrides
        and program in MEGATRON_LM_PROGRAMS
        and parse_plan(plan).kind != "auto"
    ):
        raise ValueError(
            f"attention={overrides['attention']!r} chooses the traced step's attention; plan "
            f"{plan!r} on program {program!r} is priced on Megatron-LM's own program (its "
            "fused kernels; program 'megatron-lm-flash' for its flash attention): use "
            "program='traced' or plan='auto'"
        )
    offload = _offload_request(offload, plan, cluster)
    _check_grad_reduce(grad_reduce, plan, program, offload, exact)
    search = _microbatch_search(num_microbatches, plan, microbatch_size)
    schedule = _schedule(
        plan, program, microbatch_size, None if search else num_microbatches,
        sequence_parallel, virtual_stages,
    )  # fmt: skip
    if exact and sequence_parallel:
        raise ValueError(
            "exact mode compiles the plan with autoshard's intra-op runtime, which has no "
            "sequence parallelism; drop --exact or --sequence-parallel"
        )
    if exact and offload is not None:
        raise ValueError("exact mode compiles the plan without offload; drop --exact or --offload")
    report = _simulate(
        model, cluster, gpus, plan, schedule, global_batch, recompute, dtype,
        ilp_time_limit_s, exact, overrides, program, optimizer, search, progress, offload,
        grad_reduce,
    )  # fmt: skip
    if not exact:
        return report
    checked = exact_check(report, cluster, time_limit_s=ilp_time_limit_s, **overrides)
    return dataclasses.replace(report, exact=checked)


def _check_grad_reduce(grad_reduce: str, plan: str, program: str, offload, exact: bool) -> None:
    """ValueError unless ``grad_reduce`` is a choice the plan and program price."""
    from autoshard.inter.stages import GRAD_REDUCE_CHOICES

    if grad_reduce not in GRAD_REDUCE_CHOICES:
        raise ValueError(f"grad_reduce must be one of {GRAD_REDUCE_CHOICES}, got {grad_reduce!r}")
    if grad_reduce == "microbatch":
        return
    if parse_plan(plan).kind != "auto" and program != "traced":
        raise ValueError(
            f"grad_reduce={grad_reduce!r} prices the traced step's gradient reduction (plan "
            f"'auto', or a Megatron grid with program 'traced'); plan {plan!r} on program "
            f"{program!r} is Megatron-LM's own, which reduces once per step already: drop "
            "--grad-reduce or use --program traced"
        )
    if offload is not None:
        raise ValueError(
            f"grad_reduce={grad_reduce!r} is priced without offload (a replica's state is "
            "not offloaded yet): drop --offload or use --grad-reduce microbatch"
        )
    if exact:
        raise ValueError(
            f"exact mode compiles the one-mesh step, which reduces its gradients as it "
            f"makes them; grad_reduce={grad_reduce!r} needs the pipeline runtime: drop "
            "--exact or --grad-reduce"
        )


def _offload_request(offload, plan: str, cluster):
    """None, ``"auto"`` or an :class:`~autoshard.intra.offload.placement.Offload`, checked against the
    plan (``auto`` only: the grids model systems without offload) and the cluster's host."""
    from autoshard.intra.offload.placement import parse_offload

    if offload is None:
        return None
    request = parse_offload(offload)
    if request != "auto" and not request:
        return None
    if parse_plan(plan).kind != "auto":
        raise ValueError(
            f"offload is priced on autoshard's search (plan='auto'); plan {plan!r} models "
            "Megatron-LM / PyTorch DDP / ZeRO without CPU offload: use --plan auto or drop "
            "--offload"
        )
    if load_cluster(cluster).host is None:
        raise ValueError(
            f"cluster {cluster} has no 'host' section (RAM, PCIe, CPU Adam) to price offload "
            "with: use a shipped preset or add one to the preset file"
        )
    return request


def _positive(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _microbatch_search(num_microbatches, plan, microbatch_size):
    """None for a fixed (or no) micro-batch count; for a search (``"search"``, or a tuple or
    list of counts and ``"search"``: :func:`simulate`'s docstring): (whether the default
    candidates are in, the counts given), checked."""
    if isinstance(num_microbatches, str):
        num_microbatches = (num_microbatches,)
    if not isinstance(num_microbatches, tuple | list):
        return None
    given = tuple(num_microbatches)
    for c in given:
        if c != MICROBATCH_SEARCH and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(
                f"num_microbatches: a positive int, {MICROBATCH_SEARCH!r}, or a tuple of "
                f"positive ints and {MICROBATCH_SEARCH!r}; got {c!r} in {num_microbatches!r}"
            )
    if not given:
        raise ValueError("num_microbatches=(): give at least one micro-batch count to search")
    if parse_plan(plan).kind != "auto":
        raise ValueError(
            f"searching the micro-batch count (num_microbatches={num_microbatches!r}) is for "
            f"plan='auto'; plan {plan!r} searches it when num_microbatches and "
            "microbatch_size are left out"
        )
    if microbatch_size is not None:
        raise ValueError("give microbatch_size or num_microbatches, not both")
    return MICROBATCH_SEARCH in given, tuple(c for c in given if c != MICROBATCH_SEARCH)


def _schedule(
    plan, program, microbatch_size, num_microbatches, sequence_parallel, virtual_stages
) -> Schedule:
    """The micro-batch and pipeline request, checked against the plan (docstring of
    :func:`simulate`)."""
    request = parse_plan(plan)
    _positive("microbatch_size", microbatch_size)
    _positive("num_microbatches", num_microbatches)
    _positive("virtual_stages", virtual_stages)
    if microbatch_size is not None and num_microbatches is not None:
        raise ValueError(
            "give microbatch_size (sequences per data-parallel replica) or num_microbatches "
            "(micro-batches per step), not both"
        )
    if microbatch_size is not None and request.kind == "auto":
        raise ValueError(
            "plan='auto' chooses a data-parallel degree per stage, so a micro-batch size "
            "per replica (microbatch_size, --microbatch-size) does not define it; give "
            "num_microbatches (--microbatches), the micro-batches per step"
        )
    megatron_lm = request.kind != "auto" and program in MEGATRON_LM_PROGRAMS
    if (sequence_parallel or virtual_stages > 1) and not megatron_lm:
        raise ValueError(
            "sequence parallelism and virtual (interleaved) pipeline stages are modelled on "
            "Megatron-LM's program only (plan megatron or megatron:TPxPPxDP, program "
            f"megatron-lm or megatron-lm-flash), not on plan {plan!r} with program {program!r}"
        )
    if virtual_stages > 1 and request.kind != "megatron":
        raise ValueError(
            f"virtual stages interleave a pipeline; plan {plan!r} has none (use plan "
            "megatron or megatron:TPxPPxDP with PP > 1)"
        )
    if sequence_parallel and request.kind != "megatron":
        raise ValueError(
            f"sequence parallelism splits activations over the tensor-parallel group; plan "
            f"{plan!r} has none (use plan megatron or megatron:TPxPPxDP with TP > 1)"
        )
    if sequence_parallel and request.grid is not None and request.grid[0] == 1:
        raise ValueError(f"sequence parallelism needs tensor parallelism: plan {plan} has TP = 1")
    return Schedule(microbatch_size, num_microbatches, bool(sequence_parallel), virtual_stages)


def _simulate(
    model, cluster, gpus, plan, schedule, global_batch, recompute, dtype,
    ilp_time_limit_s, exact, overrides, program="megatron-lm", optimizer="adamw", search=None,
    progress=None, offload=None, grad_reduce="microbatch",
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
    traced_cfg = traced_only_model(model, request.kind, overrides, exact)
    if traced_cfg is None:
        shape, preset_batch = gpt_shape(model, **overrides)
    else:
        shape, preset_batch = None, traced_cfg.batch_size
    seq_len = getattr(traced_cfg, "seq_len", 1)  # a Wide-ResNet: one image per "token"
    the_cluster = load_cluster(cluster, gpus)
    dtype = _check_dtype(dtype, the_cluster)
    batch = preset_batch if global_batch is None else global_batch
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"global_batch must be a positive int, got {batch!r}")
    peak = the_cluster.device.peak_flops_for(dtype)
    if request.kind == "auto":
        moe = hasattr(traced_cfg, "expert_group_size")

        def price_with(m, placement):
            if moe:
                m = moe_microbatches(traced_cfg, batch, m)
            return simulate_auto(
                model, shape, the_cluster, batch, m, recompute, dtype, peak,
                ilp_time_limit_s, overrides, seq_len=None if traced_cfg is None else seq_len,
                optimizer=optimizer, progress=progress, offload=placement,
                grad_reduce=grad_reduce,
            )  # fmt: skip

        def price(m):
            return price_with(m, offload)

        if search is None:
            return price(schedule.num_microbatches)
        with_default, extra = search
        default = None
        if with_default:
            default = (
                moe_microbatches(traced_cfg, batch, None)
                if moe
                else _default_microbatches(batch, shape, the_cluster, dtype)
            )
        for c in extra if moe else ():  # says which counts would do
            moe_microbatches(traced_cfg, batch, c)
        valid = set(moe_microbatch_counts(traced_cfg, batch)).__contains__ if moe else None
        candidates = microbatch_candidates(batch, default, extra, valid=valid)
        return search_microbatches(price, candidates, f"{model} auto on {gpus} GPUs")

    if program == "traced":
        return simulate_traced_grid(
            model, shape, the_cluster, batch, schedule, request.grid, recompute,
            dtype, peak, ilp_time_limit_s, overrides, progress, grad_reduce,
        )  # fmt: skip
    return simulate_grid(
        model, shape, the_cluster, gpus, request, batch, schedule, recompute, dtype, peak,
        program,
    )  # fmt: skip


__all__ = [
    "MEGATRON_LM_PROGRAMS",
    "PROGRAMS",
    "PLAN_FORMS",
    "PlanRequest",
    "gpt_shape",
    "parse_plan",
    "simulate",
]
