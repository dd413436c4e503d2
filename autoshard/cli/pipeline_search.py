"""The stage search behind ``plan --pipeline``: one search (:func:`search`), the search at
each micro-batch count asked for (:func:`search_microbatches`, ``--microbatches
search|N,M``), the recompute modes (``--recompute``) and the hint a budget no plan fits
gets (:func:`fit_hint`). :mod:`autoshard.cli.pipeline` prints and saves what it returns."""

from __future__ import annotations

from autoshard.cli.args import model_overrides as _overrides


def model_config(args):
    """The config of ``--model`` with the size flags given (``get_workload``'s)."""
    from autoshard.models import get_workload

    overrides = {k: v for k, v in _overrides(args).items() if v is not None}
    return get_workload(args.model, **overrides).config


def fit_hint(message: str, args) -> str:
    """The search's refusal of a budget no plan fits, with what the user can change."""
    where = (
        f"--memory-budget {args.memory_budget:g} GiB"
        if args.memory_budget is not None
        else f"the {args.cluster} preset's HBM, the default budget with --cluster"
    )
    counts = args.microbatches
    now = ",".join(map(str, counts)) if isinstance(counts, tuple) else counts
    helps = [f"more micro-batches (--microbatches N or search; {now} now)"]
    if (getattr(args, "recompute", None) or "auto") not in ("auto", "full"):
        helps.append(f"--recompute auto or full ({args.recompute} now)")
    if getattr(args, "dtype", None) in (None, "float32") and _float32(args):
        helps.append("--dtype bfloat16 (activations in float32 now)")
    helps += [
        "more devices",
        "--offload auto (state in host memory)",
        "a larger --memory-budget GiB to see the plan that needs it",
    ]
    return f"{message} ({where}). What can make it fit: {', '.join(helps[:-1])}, or {helps[-1]}"


def _float32(args) -> bool:
    """Whether the model's compute dtype (the preset's unless --dtype) is float32."""
    try:
        config = model_config(args)
    except (ValueError, KeyError, TypeError):  # a hint, never a second failure
        return False
    return str(getattr(config, "dtype", "")) == "float32"


def _recompute_modes(args) -> tuple[str, ...]:
    """The recompute modes the stage DP may give each stage (``--recompute``)."""
    from autoshard.inter.stages import RECOMPUTE_MODES

    mode = getattr(args, "recompute", None) or "auto"
    return tuple(RECOMPUTE_MODES) if mode == "auto" else (mode,)


def _microbatch_counts(args) -> tuple[int, ...]:
    """The counts ``--microbatches search[,N...]`` or ``N,M,...`` asks for, ascending:
    ``search`` is simulate's default count for a GPT preset on ``--cluster`` (the largest
    divisor of the batch up to 64, or as many as the fastest Megatron-LM layout that fits
    uses), otherwise 4 (or the largest divisor of the batch below it), with a quarter and
    half, twice and four times it where they divide the batch
    (:func:`autoshard.sim.auto.microbatch_candidates`)."""
    from autoshard.sim.auto import _default_microbatches, microbatch_candidates

    config = model_config(args)
    batch = config.batch_size
    extra = tuple(c for c in args.microbatches if c != "search")
    default = None
    if "search" in args.microbatches:
        default = max(d for d in range(1, min(batch, 4) + 1) if batch % d == 0)
        shape = _gpt_shape(args.model, config)
        if shape is not None and args.cluster:
            from autoshard.hardware.clusters import load_cluster

            cluster = load_cluster(args.cluster)
            dtype = "fp32"
            if str(config.dtype) != "float32":  # 16-bit: bf16, or the device's own (V100: fp16)
                peaks = cluster.device.peak_flops
                dtype = "bf16" if "bf16" in peaks else cluster.device.default_dtype
            default = _default_microbatches(batch, shape, cluster, dtype)
    try:
        return microbatch_candidates(batch, default, extra)
    except ValueError as err:
        raise ValueError(f"--microbatches {','.join(map(str, args.microbatches))}: {err}") from None


def _gpt_shape(model: str, config):
    """A dense GPT preset's :class:`~autoshard.sim.megatron.GPTShape` (None: not a GPT)."""
    from autoshard.models.gpt import GPT_PRESETS
    from autoshard.sim.simulate import shape_of

    return shape_of(config) if model in GPT_PRESETS else None


def search_microbatches(args, hosts: int, per_host: int, budget):
    """The whole stage search at each micro-batch count asked for; the fastest plan that
    fits the budget wins (none fits: StageBudgetError with the least budget of any count).
    Returns the plan and one record per count tried."""
    import sys

    from autoshard.inter.stages import StageBudgetError

    counts = _microbatch_counts(args)
    found, tried, least = [], [], None
    for i, m in enumerate(counts):
        print(f"{args.model}: micro-batch search {i + 1}/{len(counts)}: m={m} ...",
              file=sys.stderr, flush=True)  # fmt: skip
        row = {"num_microbatches": m}
        try:
            plan = search(args, hosts, per_host, budget, m)
        except StageBudgetError as err:
            row.update(objective_s=None, fits=False, least_budget_bytes=err.least_bytes)
            if least is None or err.least_bytes < least[1].least_bytes:
                least = (m, err)
        else:
            found.append(plan)
            row.update(objective_s=plan.objective_s, fits=True, search_seconds=plan.search_seconds)
        tried.append(row)
        print(f"{args.model}:   m={m}: "
              + (f"{row['objective_s']:.4g} s per step" if row["fits"] else "does not fit"),
              file=sys.stderr, flush=True)  # fmt: skip
    if not found:
        m, err = least
        raise StageBudgetError(
            f"{err} (the least over micro-batch counts {', '.join(map(str, counts))}: at {m})",
            err.budget_bytes,
            err.least_bytes,
        )
    best = min(found, key=lambda p: p.objective_s)  # the first (fewest micro-batches) on ties
    for row in tried:
        row["chosen"] = row["num_microbatches"] == best.num_microbatches
    return best, tried


def tried_text(tried, on_cluster: bool) -> str:
    unit = " s" if on_cluster else ""
    return "; ".join(
        f"{r['num_microbatches']}: "
        + (f"{r['objective_s']:.4g}{unit}" if r["fits"] else "does not fit")
        + (" (chosen)" if r.get("chosen") else "")
        for r in tried
    )


def search(args, hosts: int, per_host: int, budget, num_microbatches: int):
    from autoshard.api_pipeline import auto_stage_plan
    from autoshard.inter.options import StageSearchOptions
    from autoshard.inter.progress import Progress
    from autoshard.inter.stages import grad_reduces_for

    return auto_stage_plan(
        args.model,
        hosts,
        per_host,
        StageSearchOptions(
            num_microbatches,
            stages=args.pipeline,
            num_stages=args.stages,
            schedule=args.schedule,
            recompute_modes=_recompute_modes(args),
            memory_budget_bytes=budget,
            solver=args.solver or "highs",
            time_limit_s=60.0 if args.time_limit is None else args.time_limit,
            grad_reduces=grad_reduces_for(getattr(args, "grad_reduce", None) or "microbatch"),
        ),
        cluster=args.cluster,
        optimizer=args.optimizer,
        progress=Progress(args.model, enabled=not getattr(args, "quiet", False)),
        offload=getattr(args, "offload", None),
        **_overrides(args),
    )
