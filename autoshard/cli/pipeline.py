"""``autoshard plan/run --pipeline ...``: the inter-operator pass on the command line.

``plan --pipeline auto|equal-layer|equal-flops --devices N --microbatches K`` searches
pipeline stages with stage costs from intra-op ILPs
(:func:`autoshard.api_pipeline.auto_stage_plan`; abstract shapes, nothing allocated) and prints
the stages or JSON (``--json``: ``stages`` with ``layers``, ``submesh``,
``logical_mesh``, ``latency_s``, ``peak_bytes``; ``objective_s``; ``search_seconds``).
``run --pipeline ... --schedule 1f1b|gpipe|interleaved [--virtual-stages V]
[--recompute none|selective|full|auto] --steps N`` trains a small model with the
pipeline runtime (:func:`autoshard.api_pipeline.auto_pipeline`: every stage under its own
intra-op plan) on fake CPU devices, SGD by default, and with ``--check`` compares losses
and parameters with the single-device training step (exit 1 on a mismatch).
:func:`add_pipeline_args` adds the flags to ``plan`` and ``run``; :func:`register` adds
the older ``pipeline-plan`` and ``pipeline-run`` sub-commands (same code).
"""

from __future__ import annotations

import json

from autoshard.cli.args import add_model_args, binary_size, cluster_presets, positive_float
from autoshard.cli.args import model_overrides as _overrides
from autoshard.cli.args import positive_int as _positive_int
from autoshard.cli.pipeline_search import fit_hint, search, search_microbatches, tried_text
from autoshard.inter.options import STAGE_METHODS

RUN_SCHEDULES = ("1f1b", "gpipe", "interleaved")
RUN_RECOMPUTE = ("none", "selective", "full", "auto")


def cmd_pipeline_plan(args) -> int:
    """Search stages and print them (``--json``: the InterPlan's JSON and the memory
    budget). With ``--cluster`` and no ``--memory-budget`` the budget is the preset's HBM
    per device, as on one mesh; a model no plan fits is refused with what could help."""
    budget = None if args.memory_budget is None else args.memory_budget * 2**30
    if budget is None and args.cluster:  # as on one mesh: the preset's HBM by default
        budget = _preset_hbm(args.cluster)
    hosts = args.hosts
    per_host = getattr(args, "devices_per_host", None)
    if per_host is None:
        if args.devices % hosts:
            raise ValueError(f"--devices {args.devices} does not split into --hosts {hosts}")
        per_host = args.devices // hosts
    _warn_one_host(args.cluster, hosts, per_host)
    from autoshard.inter.stages import StageBudgetError

    tried = None
    try:
        if isinstance(args.microbatches, tuple):  # --microbatches search[,N...] / N,M
            plan, tried = search_microbatches(args, hosts, per_host, budget)
        else:
            plan = search(args, hosts, per_host, budget, args.microbatches)
    except StageBudgetError as err:
        raise ValueError(fit_hint(str(err), args)) from None
    if getattr(args, "out", None):
        _save_pipeline_plan(args, plan, hosts, per_host)
    if args.json:
        record = plan.to_json()
        record["memory_budget_bytes"] = budget
        if tried is not None:
            record["microbatch_search"] = tried
        print(_dumps(record))
        return 0
    print(
        f"{plan.model}: {len(plan.stages)} stages on {hosts}x{per_host} "
        f"devices, {plan.num_microbatches} microbatches, {plan.schedule} ({plan.method})"
    )
    if tried is not None:
        print("micro-batch counts searched: " + tried_text(tried, bool(args.cluster)))
    if budget is not None:
        where = (
            "--memory-budget"
            if args.memory_budget is not None
            else f"the {args.cluster} preset's HBM"
        )
        print(f"memory budget: {binary_size(budget)} per device ({where})")
    return _print_stages(args, plan)


def _dumps(record: dict) -> str:
    """``record`` as indented JSON, its per-tensor ``stage_specs`` (megabytes on a large
    model: gpt-39b 1.3 MB) each stage's on one line: Python's indenting encoder takes
    0.4 s over 4 MB where the compact one takes 0.07 s."""
    specs = record.get("stage_specs")
    if not isinstance(specs, list):
        return json.dumps(record, indent=2)
    mark = "\u0000stage-specs\u0000"
    text = json.dumps({**record, "stage_specs": mark}, indent=2)
    inner = ",\n    ".join(json.dumps(s, separators=(",", ":")) for s in specs)
    return text.replace(json.dumps(mark), f"[\n    {inner}\n  ]" if specs else "[]", 1)


def _preset_hbm(cluster: str) -> float | None:
    """The HBM per device of a cluster preset (None: the preset gives none)."""
    import math

    from autoshard.hardware.clusters import load_cluster

    hbm = load_cluster(cluster).device.hbm_bytes
    return float(hbm) if hbm and math.isfinite(hbm) else None


def _print_stages(args, plan) -> int:
    def cost(seconds: float) -> str:  # seconds on a named cluster, else abstract units
        if args.cluster:
            return f"{seconds * 1e3:.4g} ms"
        return f"{seconds:.4g} (abstract cost units: no --cluster)"

    for i, s in enumerate(plan.stages):
        first, last = s.layers[0], s.layers[-1]
        print(
            f"  stage {i}: {first}..{last} ({len(s.layers)} layer"
            f"{'' if len(s.layers) == 1 else 's'}) on sub-mesh "
            f"{s.submesh[0]}x{s.submesh[1]} as (dp, tp) = {tuple(s.logical_mesh)}: "
            f"{cost(s.latency_s)} per microbatch, peak {binary_size(s.peak_bytes)} per device"
            + ("" if s.recompute == "none" else f", {s.recompute} recompute")
            + (", gradients reduced once a step" if s.grad_reduce == "step" else "")
        )
    if plan.offload:
        for line in offload_lines(plan.offload):
            print(line)
    phases = ", ".join(f"{k} {v:.2f} s" for k, v in plan.phase_seconds.items())
    print(
        f"pipeline latency {cost(plan.objective_s)}; search {plan.search_seconds:.2f} s "
        f"({phases}); {plan.num_ilps} ILPs, {plan.num_cache_hits} cache hits"
    )
    return 0


def _warn_one_host(cluster, hosts: int, per_host: int) -> None:
    """A line on stderr where the devices of a cluster preset are searched as more per
    host than its nodes have (``--devices 64`` without ``--hosts``: one host of 64, with
    the nodes' own links between all of them, not Alpa's 8 x 8)."""
    import sys

    from autoshard.hardware.clusters import load_cluster

    if not cluster:
        return
    node = load_cluster(cluster).devices_per_node
    if per_host > node and per_host % node == 0:
        print(
            f"autoshard: warning: searching {hosts} host{'s' if hosts > 1 else ''} x "
            f"{per_host} devices, but a {cluster} node has {node} GPUs: add --hosts "
            f"{hosts * per_host // node} to search {hosts * per_host // node} x {node}",
            file=sys.stderr,
        )


def offload_lines(record) -> list[str]:
    """What a pipelined plan keeps in host memory, per stage (``plan.offload``)."""
    gib = 2**30
    where = record["where"]
    labels = record.get("offload_per_stage") or [record["offload"]] * len(
        record["host_bytes_per_stage"]
    )
    wheres = record.get("where_per_stage") or [where] * len(labels)
    auto = " (chosen by auto)" if record.get("chosen_by") else ""
    tail = (
        f"{record['host_bytes_per_node'] / gib:.3g} GiB per node of "
        f"{record['host_memory_bytes'] / gib:.0f} usable"
    )
    if len(set(labels)) == 1:
        on_host = [c for c, w in where.items() if w == "host" and c != "update"]
        head = (
            f"offload {record['offload']}{auto}: {', '.join(on_host)} in host memory, update "
            f"on {where['update']}; {tail}"
        )
    else:
        head = f"offload per stage{auto}: {' | '.join(labels)}; {tail}"
    lines = [head]
    if record.get("why"):  # auto: why it offloads
        lines.append(f"  auto offloads: {record['why']}")
    per_stage = zip(
        labels, wheres, record["host_bytes_per_stage"], record["exposed_s_per_stage"], strict=True
    )
    for i, (label, w, nbytes, exposed) in enumerate(per_stage):
        lines.append(
            f"  stage {i}: {label}, {binary_size(nbytes)} per device in host memory, "
            f"{exposed * 1e3:.4g} ms per step exposed transfers"
            + (" and host update" if w["update"] == "host" else "")
        )
    return lines


def _save_pipeline_plan(args, plan, hosts: int, per_host: int) -> None:
    """``plan --pipeline ... --out FILE``: a pipeline plan file
    (:class:`~autoshard.ir.planfile.PipelinePlanFile`) that explain and export read."""
    import sys

    from autoshard.ir.planfile import PipelinePlanFile
    from autoshard.models import get_workload

    overrides = {k: v for k, v in _overrides(args).items() if v is not None}
    config = get_workload(args.model, **overrides).config
    fingerprint = {
        "model": args.model,
        "overrides": overrides,
        "optimizer": args.optimizer,
        "devices": {"hosts": hosts, "per_host": per_host},
        "cluster": args.cluster,
    }
    if getattr(args, "offload", None):
        fingerprint["offload"] = args.offload
    extra = {
        "global_batch": config.batch_size,
        "dtype": getattr(config, "dtype", None) and str(config.dtype),
    }
    PipelinePlanFile(plan.to_json(), fingerprint, extra).save(args.out)
    print(f"plan saved to {args.out}", file=sys.stderr)


def _ensure_devices(n: int):
    import jax

    if not jax.distributed.is_initialized():  # a launched process has made its share
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:
            pass  # a backend already started: use what it has
    devices = jax.devices()
    if len(devices) < n:
        raise ValueError(
            f"--devices {n} but JAX has {len(devices)} devices; run as "
            f"`autoshard pipeline-run --devices {n} ...` in a fresh process"
        )
    return devices[:n]


def cmd_pipeline_run(args) -> int:
    """Train with the pipeline runtime and (``--check``) compare with one device."""
    import jax
    import numpy as np

    from autoshard.api_pipeline import auto_pipeline
    from autoshard.models import get_workload, make_optimizer, make_train_step

    devices = _ensure_devices(args.devices)
    workload = get_workload(args.model, **_overrides(args))
    opt = make_optimizer(getattr(args, "optimizer", None) or "sgd")
    params, opt_state, batch = workload.init_train_args(opt, seed=0)
    if args.pipeline != "auto" and args.stages is None:
        raise ValueError(f"--pipeline {args.pipeline} needs --stages")
    trainer = auto_pipeline(
        workload.loss_fn,
        opt,
        params,
        batch,
        devices=devices,
        num_microbatches=args.microbatches,
        stages=args.pipeline,
        num_stages=args.stages,
        schedule=args.schedule,
        solver=getattr(args, "solver", None) or "highs",
        recompute=getattr(args, "recompute", None) or "none",
        virtual_stages=getattr(args, "virtual_stages", None) or 1,
        cluster=getattr(args, "cluster", None),
        offload=getattr(args, "offload", None),
        grad_reduce=getattr(args, "grad_reduce", None) or "microbatch",
    )
    print(trainer.plan)
    if trainer.inter_plan is not None and trainer.inter_plan.offload:
        for line in offload_lines(trainer.inter_plan.offload):
            print(line)
        print(f"optimizer state at rest in memory kind: {_state_memory_kinds(trainer)}")
        if "activations" in trainer.inter_plan.offload["classes"]:
            print(
                "saved activations between forward and backward in memory kind: "
                + _residual_memory_kinds(trainer)
            )
        if any(st.masters_on_host for st in trainer.stage_executables):
            count = sum(
                leaf.sharding.memory_kind == "pinned_host"
                for st in trainer.stage_executables
                for leaf in jax.tree.leaves(st.params)
            )
            print(f"master weights at rest in pinned_host: {count} arrays")
    from autoshard.runtime.distributed import to_host

    losses = [float(to_host(trainer.step(batch))) for _ in range(args.steps)]
    print("pipeline losses:      " + ", ".join(f"{x:.6f}" for x in losses))
    if not args.check:
        return 0
    step = jax.jit(make_train_step(workload.loss_fn, opt))
    want = []
    p, s = params, opt_state
    for _ in range(args.steps):
        p, s, loss = step(p, s, batch)
        want.append(float(loss))
    print("single-device losses: " + ", ".join(f"{x:.6f}" for x in want))
    loss_ok = np.allclose(losses, want, rtol=args.rtol, atol=0.0)
    worst, worst_name = 0.0, ""
    got_leaves = jax.tree_util.tree_leaves_with_path(trainer.params)
    for (path, g), w in zip(got_leaves, jax.tree.leaves(p), strict=True):
        w = np.asarray(w)
        err = float(np.max(np.abs(np.asarray(g) - w))) / max(float(np.max(np.abs(w))), 1e-30)
        if err > worst:
            worst, worst_name = err, jax.tree_util.keystr(path)
    ok = loss_ok and worst <= args.rtol
    print(
        f"vs single device over {args.steps} step(s): max parameter rel. error {worst:.2e}"
        f"{f' ({worst_name})' if worst_name else ''} (rtol {args.rtol:g}): "
        + ("MATCH" if ok else "MISMATCH")
    )
    _print_stage_memory(trainer)
    return 0 if ok else 1


# flags of `plan` / `run` that the pipeline path does not use yet, with the reason
IGNORED_BY_PIPELINE = {
    "plan": (
        ("--verify", "verify", "the verifier checks one-mesh plans; stage plans are not compiled"),
        ("--merge-elementwise", "merge_elementwise", "the stage search's ILPs do not merge"),
    ),
    "run": (
        (
            "--cluster",
            "cluster",
            "the pipeline runtime plans its stages on abstract costs; it takes a cluster "
            "only with --offload, whose host figures come from it",
        ),
        ("--memory-budget", "memory_budget", "the pipeline runtime takes no budget yet"),
        ("--json", "json", "the pipeline runtime prints text only"),
        ("--time-limit", "time_limit", "the pipeline runtime's ILPs use their own limit"),
        ("--merge-elementwise", "merge_elementwise", "the stage search's ILPs do not merge"),
    ),
}


def refuse_ignored_pipeline_flags(args, command: str) -> None:
    """ValueError naming every flag ``command --pipeline`` would ignore, and why."""
    given = [
        f"{flag} ({why})"
        for flag, dest, why in IGNORED_BY_PIPELINE.get(command, ())
        if getattr(args, dest, None) not in (None, False)
        and not (dest == "cluster" and getattr(args, "offload", None) not in (None, "none"))
    ]
    if given:
        raise ValueError(
            f"{command} --pipeline does not use {'; '.join(given)}: drop "
            + ("it" if len(given) == 1 else "them")
        )


def _state_memory_kinds(trainer) -> str:
    """The memory kinds of the stages' floating-point optimizer state, as they rest."""
    import jax
    import jax.numpy as jnp

    kinds = {
        leaf.sharding.memory_kind
        for st in trainer.stage_executables
        for leaf in jax.tree.leaves(st.opt_state)
        if jnp.issubdtype(leaf.dtype, jnp.inexact)
    }
    return ", ".join(sorted(map(str, kinds)))


def _residual_memory_kinds(trainer) -> str:
    """The memory kinds of the stages' forward residuals (the compiled forwards' results
    the backward takes), as they wait for the backward."""
    import jax

    kinds = {
        sharding.memory_kind
        for i in range(len(trainer.stage_executables))
        for sharding in jax.tree.leaves(trainer.compiled_forward(i).output_shardings[1])
    }
    return ", ".join(sorted(map(str, kinds)))


def _print_stage_memory(trainer) -> None:
    """Predicted (stage search) vs compiled (runtime) peak memory per stage; printed, not
    folded into the exit status (as ``demo`` does with verify)."""
    from autoshard.runtime.stage_memory import AGREEMENT, stage_memory

    if trainer.virtual_stages > 1:
        print("peak memory per stage: not reported for interleaved schedules yet")
        return

    def mib(b: float) -> str:
        return f"{b / 2**20:.3f} MiB"

    rows = stage_memory(trainer)
    print("peak memory per device, predicted (stage search) vs compiled (runtime):")
    for m in rows:
        print(
            f"  stage {m.stage}: predicted {mib(m.predicted_bytes)}, compiled "
            f"{mib(m.compiled_bytes)} = state {mib(m.state_bytes)} + {m.in_flight} x "
            f"residuals {mib(m.residual_bytes)} + working {mib(m.working_bytes)}: "
            f"ratio {m.ratio:.2f}, " + ("agrees" if m.agrees else "DIFFERS")
        )
    if not all(m.agrees for m in rows):
        print(
            f"  note: more than {AGREEMENT:.0%} apart on "
            f"{sum(not m.agrees for m in rows)} stage(s). The runtime keeps what jax.vjp "
            "of each stage saves (its residuals, at the shardings XLA chose, plus received "
            "activations and batch slices); the stage search counts the buffers the traced "
            "single-program step keeps live from forward to backward. Without full "
            "recompute the gap is in that per-microbatch term; which residuals make it is "
            "not broken down yet (docs/distributed.md)"
        )


def add_pipeline_args(p, run: bool) -> None:
    """The ``--pipeline`` flags of ``plan`` (``run=False``) and ``run``."""
    g = p.add_argument_group("pipeline (instead of --mesh)")
    g.add_argument(
        "--pipeline",
        choices=STAGE_METHODS,
        help="split the model into pipeline stages: Alpa's stage DP (auto) or equal stages",
    )
    g.add_argument(
        "--devices",
        dest="pipeline_devices",
        type=_positive_int,
        help="devices to pipeline over (fake CPU devices when no accelerator)",
    )
    # defaults filled in by pipeline_defaults(): None here tells a typed flag from a default
    if run:
        g.add_argument(
            "--microbatches", type=_positive_int, help="microbatches per step (default: 4)"
        )
    else:
        from autoshard.cli.simulate import microbatches_arg

        g.add_argument(
            "--microbatches",
            type=microbatches_arg,
            help="microbatches per step (default: 4); or 'search' (the whole search at a "
            "default count -- simulate's for a GPT preset on --cluster, else 4 -- a quarter, "
            "half, 2x and 4x it: the fastest plan that fits wins), or counts and 'search' "
            "separated by commas (64,128,256)",
        )
    g.add_argument("--stages", type=_positive_int, help="number of stages (auto: any)")
    g.add_argument(
        "--schedule",
        choices=RUN_SCHEDULES if run else ("1f1b", "gpipe"),
        help="pipeline schedule (default: 1f1b)",
    )
    if run:
        g.add_argument(
            "--virtual-stages",
            type=_positive_int,
            help="model chunks per stage (--schedule interleaved: Megatron's interleaved 1F1B; "
            "default: 1)",
        )
    g.add_argument(
        "--recompute",
        choices=RUN_RECOMPUTE,
        help="activation recompute of every stage's inner layers, or auto (the stage "
        "search chooses per stage; default: "
        + (
            "none)"
            if run
            else "auto: a stage recomputes only where the memory budget needs it, since "
            "recompute only adds time)"
        ),
    )
    # plan --pipeline searches with it; run --pipeline runs what the search chose
    g.add_argument(
        "--grad-reduce",
        choices=("microbatch", "step", "auto"),
        help="where a stage reduces its data-parallel gradient: every microbatch "
        "(default), once a step (dp replicas of a plan over 'model', on every stage "
        "with dp > 1 the search keeps) or auto (the stage search chooses per stage, "
        "with its logical mesh)",
    )
    if not run:
        g.add_argument("--hosts", type=_positive_int, help="hosts the devices span (default: 1)")


PIPELINE_ONLY = (
    ("--microbatches", "microbatches", 4),
    ("--stages", "stages", None),
    ("--schedule", "schedule", "1f1b"),
    ("--hosts", "hosts", 1),
    ("--virtual-stages", "virtual_stages", 1),
    ("--recompute", "recompute", "none"),
    ("--grad-reduce", "grad_reduce", "microbatch"),
)

# where ``plan --pipeline`` defaults differ from ``run --pipeline``'s: the plan's stage DP
# takes recompute per stage as ``simulate --plan auto`` does (the runtime's default stays
# none: ``run --pipeline --recompute auto`` searches the same way)
PLAN_DEFAULTS = {"recompute": "auto"}


def pipeline_defaults(args, command: str, pipeline: bool) -> None:
    """Fill in the pipeline flags' defaults under ``--pipeline``; without it, refuse any
    that was typed (ValueError): one mesh has no stages to use them."""
    if not pipeline:
        typed = [flag for flag, dest, _ in PIPELINE_ONLY if getattr(args, dest, None) is not None]
        if typed:
            raise ValueError(
                f"{command}: {', '.join(typed)} set pipeline stages; add --pipeline "
                "auto|equal-layer|equal-flops (with --devices N instead of --mesh), or drop them"
            )
        return
    for _flag, dest, default in PIPELINE_ONLY:
        if hasattr(args, dest) and getattr(args, dest) is None:
            setattr(args, dest, PLAN_DEFAULTS.get(dest, default) if command == "plan" else default)


def register(subparsers) -> None:
    """Add ``pipeline-plan`` and ``pipeline-run`` to ``subparsers`` (argparse)."""
    p = subparsers.add_parser(
        "pipeline-plan", help="search pipeline stages with intra-op ILP stage costs"
    )
    add_model_args(p)
    p.add_argument("--hosts", type=_positive_int, default=1)
    p.add_argument("--devices-per-host", type=_positive_int, default=8)
    p.add_argument("--pipeline", choices=STAGE_METHODS, default="auto")
    p.add_argument(
        "--microbatches", type=_positive_int, default=4, help="micro-batches per step (4)"
    )
    p.add_argument("--stages", type=_positive_int, help="number of stages (auto: any)")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    p.add_argument("--cluster", help=f"cluster preset ({cluster_presets()}) or .json")
    p.add_argument("--memory-budget", type=float, help="per-device memory budget in GiB")
    p.add_argument("--solver", choices=("cbc", "highs"), default="highs")
    p.add_argument("--time-limit", type=float, default=60.0, help="per-ILP time limit (s)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_pipeline_plan)

    p = subparsers.add_parser(
        "pipeline-run", help="train with the pipeline runtime on fake CPU devices"
    )
    add_model_args(p, optimizer=False)
    p.add_argument("--devices", type=_positive_int, default=8, help="fake CPU devices")
    p.add_argument("--pipeline", choices=STAGE_METHODS, default="equal-layer")
    p.add_argument("--stages", type=_positive_int)
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    p.add_argument("--microbatches", type=_positive_int, default=4)
    p.add_argument("--steps", type=_positive_int, default=2)
    p.add_argument("--check", action="store_true", help="compare with the single-device step")
    p.add_argument("--rtol", type=positive_float, default=1e-5)
    p.set_defaults(func=cmd_pipeline_run)
