"""Whether an exported configuration is one its target can launch (jax-free).

Takes a target's settings (an :class:`~autoshard.report.export.Export`'s ``config``) and
the facts of the job (:class:`JobFacts`: GPUs, transformer layers, global batch,
microbatches); returns the target's own start-up rules it breaks, in words
(:func:`launch_problems`; empty: it launches). :func:`nearest_grid` finds the
tensor x pipeline x data-parallel grid closest to a plan's that keeps every rule.

The rules are the targets' own start-up checks:

* Megatron-LM: world size = TP x PP x DP; ``--num-layers`` divisible by PP;
  ``--global-batch-size`` divisible by ``--micro-batch-size`` x DP;
  ``--recompute-granularity full`` needs ``--recompute-method`` (uniform or block) and
  ``--recompute-num-layers``; selective recompute takes no method.
* DeepSpeed: ``train_batch_size`` = ``train_micro_batch_size_per_gpu`` x
  ``gradient_accumulation_steps`` x data-parallel size (GPUs / pipeline stages); the
  stages of ``PipelineModule(num_stages=...)`` divide the GPUs, and there are no more
  stages than layers.
* MaxText: the product of the ``ici_*`` parallelisms = the devices of the slice;
  decoder layers divisible by ``ici_pipeline_parallelism``; ``num_pipeline_microbatches``
  divisible by it; ``remat_policy`` one MaxText knows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

MEGATRON_RECOMPUTE_METHODS = ("uniform", "block")
MAXTEXT_REMAT_POLICIES = (
    "minimal",
    "minimal_with_context",
    "save_dot_with_context_except_mlp",
    "save_dot_except_mlpwi",
    "save_dot_except_mlp",
    "save_qkv_proj",
    "save_out_proj",
    "full",
)


@dataclass(frozen=True)
class JobFacts:
    """What the configuration must fit: ``layers`` is the transformer layers the pipeline
    splits (None: not a layered model, the layer rules are not checked)."""

    gpus: int
    layers: int | None
    global_batch: int
    microbatches: int = 1


@dataclass(frozen=True)
class Grid:
    """Tensor x pipeline x data parallelism (Megatron-LM's TPxPPxDP)."""

    tp: int
    pp: int
    dp: int

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        return f"TP {self.tp} x PP {self.pp} x DP {self.dp} = {self.gpus} GPUs"


def _megatron(config: Mapping, facts: JobFacts) -> list[str]:
    tp = int(config["tensor-model-parallel-size"])
    pp = int(config["pipeline-model-parallel-size"])
    out = []
    if facts.gpus % (tp * pp):
        out.append(f"TP {tp} x PP {pp} does not divide the {facts.gpus} GPUs")
        dp = None
    else:
        dp = facts.gpus // (tp * pp)
    if facts.layers is not None and facts.layers % pp:
        out.append(f"{facts.layers} layers do not split into {pp} pipeline stages")
    micro, batch = int(config["micro-batch-size"]), int(config["global-batch-size"])
    if dp and batch % (micro * dp):
        out.append(f"global batch {batch} is not a multiple of micro batch {micro} x DP {dp}")
    if config.get("recompute-granularity") == "full":
        if config.get("recompute-method") not in MEGATRON_RECOMPUTE_METHODS:
            out.append("--recompute-granularity full needs --recompute-method uniform|block")
        if not config.get("recompute-num-layers"):
            out.append("--recompute-granularity full needs --recompute-num-layers")
    elif config.get("recompute-method"):
        out.append("--recompute-method is for --recompute-granularity full only")
    return out


def _deepspeed(config: Mapping, facts: JobFacts, pipeline_stages: int) -> list[str]:
    out = []
    if facts.gpus % pipeline_stages:
        out.append(f"{pipeline_stages} pipeline stages do not divide the {facts.gpus} GPUs")
        return out
    if facts.layers is not None and pipeline_stages > max(facts.layers, 1):
        out.append(f"{pipeline_stages} pipeline stages are more than the {facts.layers} layers")
    dp = facts.gpus // pipeline_stages
    micro = int(config["train_micro_batch_size_per_gpu"])
    steps = int(config["gradient_accumulation_steps"])
    batch = int(config["train_batch_size"])
    if batch != micro * steps * dp:
        out.append(
            f"train_batch_size {batch} != micro batch {micro} x {steps} accumulation steps "
            f"x DP {dp}"
        )
    return out


def _maxtext(config: Mapping, facts: JobFacts) -> list[str]:
    out = []
    ici = [v for k, v in config.items() if k.startswith("ici_") and k.endswith("parallelism")]
    if math.prod(int(v) for v in ici) != facts.gpus:
        out.append(
            f"the ici_* parallelisms multiply to {math.prod(int(v) for v in ici)}, "
            f"not the {facts.gpus} devices"
        )
    pp = int(config.get("ici_pipeline_parallelism", 1))
    if pp > 1:
        if facts.layers is not None and facts.layers % pp:
            out.append(f"{facts.layers} decoder layers do not split into {pp} pipeline stages")
        m = int(config.get("num_pipeline_microbatches", facts.microbatches))
        if m % pp:
            out.append(f"{m} pipeline microbatches are not divisible by {pp} stages")
    per_device = int(config["per_device_batch_size"])
    if per_device < 1 or per_device * facts.gpus != facts.global_batch:
        out.append(
            f"per_device_batch_size {per_device} x {facts.gpus} devices is not the global "
            f"batch {facts.global_batch}"
        )
    if config.get("remat_policy") not in MAXTEXT_REMAT_POLICIES:
        out.append(f"remat_policy {config.get('remat_policy')!r} is not a MaxText policy")
    return out


def launch_problems(
    target: str, config: Mapping, facts: JobFacts, pipeline_stages: int = 1
) -> list[str]:
    """The target's start-up rules ``config`` breaks for ``facts`` (empty: it launches)."""
    if target == "megatron":
        return _megatron(config, facts)
    if target == "deepspeed":
        return _deepspeed(config, facts, pipeline_stages)
    if target == "maxtext":
        return _maxtext(config, facts)
    raise ValueError(f"unknown export target {target!r}")


def grid_fits(target: str, grid: Grid, facts: JobFacts) -> bool:
    """Whether a configuration on ``grid`` can satisfy ``target``'s rules for ``facts``."""
    if grid.gpus != facts.gpus:
        return False
    if facts.layers is not None and grid.pp > 1 and facts.layers % grid.pp:
        return False
    m = facts.microbatches
    if target == "megatron":
        return facts.global_batch % (grid.dp * m) == 0
    if target == "deepspeed":
        return grid.tp == 1 and facts.global_batch % (grid.dp * m) == 0
    if target == "maxtext":
        return facts.global_batch % facts.gpus == 0 and (grid.pp == 1 or m % grid.pp == 0)
    raise ValueError(f"unknown export target {target!r}")


def nearest_grid(target: str, want: Grid, facts: JobFacts) -> Grid | None:
    """The grid on ``facts.gpus`` GPUs that ``target`` can launch, nearest ``want``:
    fewest changes in pipeline stages first, then tensor parallelism (by ratio)."""

    def distance(g: Grid) -> tuple[float, float, float]:
        return (
            abs(math.log(g.pp / want.pp)),
            abs(math.log(g.tp / want.tp)),
            abs(math.log(g.dp / want.dp)),
        )

    n = facts.gpus
    grids = [
        Grid(tp, pp, n // (tp * pp))
        for tp in range(1, n + 1)
        if n % tp == 0
        for pp in range(1, n // tp + 1)
        if (n // tp) % pp == 0
    ]
    fits = [g for g in grids if grid_fits(target, g, facts)]
    return min(fits, key=distance) if fits else None
