"""Public API: the one module that chains the passes (trace -> graph -> plan -> run)."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections import Counter
from dataclasses import dataclass

from autoshard.api_budget import (  # fit_compiled_budget: re-exported
    cluster_memory_budget,
    fit_compiled_budget,
    plan_under_binding_budget,
    refuse_budget_below_the_state,
)
from autoshard.hardware.mesh import parse_mesh_shape  # re-exported (jax-free, for the CLI)
from autoshard.intra.baselines.tables import BaselineRefusedError
from autoshard.intra.problem.options import IntraOptions
from autoshard.ir.graph import Graph, build_graph
from autoshard.models import Workload, get_workload, make_optimizer, make_train_step
from autoshard.trace.jaxpr import TracedProgram, trace_train_step


@dataclass(frozen=True)
class TracedWorkload:
    workload: Workload
    optimizer_name: str
    program: TracedProgram
    graph: Graph


def trace_workload(
    workload: Workload | str, optimizer: str = "adamw", **overrides
) -> TracedWorkload:
    """Trace a model's full training step (forward, backward, optimizer) with abstract shapes."""
    if isinstance(workload, str):
        workload = get_workload(workload, **overrides)
    opt = make_optimizer(optimizer)
    step = make_train_step(workload.loss_fn, opt)
    program = trace_train_step(step, *workload.abstract_train_args(opt))
    return TracedWorkload(workload, optimizer, program, build_graph(program.records))


@dataclass(frozen=True)
class ModelSummary:
    model: str
    params: int
    # forward + backward model FLOPs of matrix products: dot_general and fused attention
    matmul_flops_per_step: float
    flops_per_step: float  # forward + backward, all ops
    update_flops_per_step: float  # optimizer update
    num_eqns: int
    layers: tuple[str, ...]
    eqns_by_primitive: dict[str, int]
    layer_flops: dict[str, dict[str, float]]  # layer -> phase -> FLOPs
    unknown_flops: tuple[str, ...]

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "params": self.params,
            "matmul_flops_per_step": self.matmul_flops_per_step,
            "flops_per_step": self.flops_per_step,
            "update_flops_per_step": self.update_flops_per_step,
            "num_eqns": self.num_eqns,
            "layers": list(self.layers),
            "eqns_by_primitive": self.eqns_by_primitive,
            "layer_flops": self.layer_flops,
            "unknown_flops": list(self.unknown_flops),
        }


def summarize_graph(name: str, graph: Graph) -> ModelSummary:
    layer_flops: dict[str, dict[str, float]] = {
        layer: {"forward": 0.0, "backward": 0.0, "update": 0.0} for layer in graph.layers
    }
    for node in graph.nodes:
        if node.layer is not None:
            layer_flops[node.layer][node.phase] += node.flops
    counts = Counter(n.primitive for n in graph.nodes)
    return ModelSummary(
        model=name,
        params=graph.num_params(),
        matmul_flops_per_step=graph.matmul_flops(),
        flops_per_step=graph.flops_where(),
        update_flops_per_step=graph.flops_where(phases=("update",)),
        num_eqns=len(graph.nodes),
        layers=graph.layers,
        eqns_by_primitive=dict(counts.most_common()),
        layer_flops=layer_flops,
        unknown_flops=graph.unknown_flops,
    )


def inspect_model(name: str, optimizer: str = "adamw", **overrides) -> ModelSummary:
    """Parameter count, FLOPs and equation statistics of a model's training step."""
    traced = trace_workload(name, optimizer, **overrides)
    return summarize_graph(name, traced.graph)


# ----------------------------------------------------------------------------- intra-op


def default_axis_names(shape: tuple[int, ...]) -> tuple[str, ...]:
    if len(shape) == 1:
        return ("data",)
    if len(shape) == 2:
        return ("data", "model")
    return tuple(f"axis{i}" for i in range(len(shape)))


def device_mesh_for(mesh, axis_names=None, cluster=None):
    """A cost-model mesh (:class:`autoshard.hardware.mesh.DeviceMesh`) for ``mesh``.

    ``mesh`` may be a DeviceMesh (used as is), a ``jax.sharding.Mesh``, a shape tuple or
    a string like ``"2x4"``.  The default costs are Alpa's test mesh (alpha 1, beta 1
    on slow axes and 0.1 on the last, fast axis): relative units, as in Alpa's tests.
    With ``cluster`` (a preset name such as ``dgx-a100`` or a preset file) the costs are
    in seconds: NVLink for axes inside a node, the network for axes across nodes.
    """
    from autoshard.hardware.mesh import XLA_GPU_MEMORY, DeviceMesh, preset_mesh, relative_mesh

    if isinstance(mesh, DeviceMesh):
        return mesh
    if hasattr(mesh, "axis_names") and hasattr(mesh, "devices"):  # jax.sharding.Mesh
        shape = tuple(int(s) for s in mesh.devices.shape)
        axis_names = tuple(mesh.axis_names)
    elif isinstance(mesh, str):
        shape = parse_mesh_shape(mesh)
    else:
        shape = tuple(int(s) for s in mesh)
    names = tuple(axis_names) if axis_names else default_axis_names(shape)
    if len(names) != len(shape):
        raise ValueError(f"mesh shape {shape} has {len(shape)} axes but axis names {names}")
    if cluster is not None:  # real units: the preset's links, GEMM table, HBM and memory
        return preset_mesh(cluster, shape, names)
    layout = xla_cpu_memory_layout() if _runs_on_cpu(mesh) else XLA_GPU_MEMORY
    return relative_mesh(shape, names, layout)


def _refuse_baseline(graph, dmesh, options, pinned, baseline, err) -> None:
    """Raise BaselineRefusedError naming the op where ``baseline``'s data parallelism
    breaks (found by propagating its forbidden pairs); return when none is found."""
    from autoshard.intra.baselines.tables import data_parallel_refusal
    from autoshard.intra.problem.build import build_problem

    ip = build_problem(graph, dmesh, options, pinned_inputs=pinned)
    refusal = data_parallel_refusal(ip, baseline)
    if refusal is not None:
        raise refusal from err


@functools.cache
def xla_cpu_memory_layout():
    """How this jaxlib's XLA:CPU lays a step's memory out: ``XLA_CPU_MEMORY``, with
    ``narrow_dots_in_f32`` as a compiled bf16 dot says.  XLA:CPU up to jaxlib 0.10
    computes bf16 dots in f32 (an f32 result buffer); jaxlib 0.11's and 0.12's (YNNPACK)
    compute them in bf16.  Compiles one 64 x 64 dot on the CPU backend, once per process."""
    import re

    import jax
    import jax.numpy as jnp

    from autoshard.hardware.mesh import XLA_CPU_MEMORY

    narrow = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
    with jax.default_device(jax.devices("cpu")[0]):
        text = jax.jit(jnp.matmul).lower(narrow, narrow).compile().as_text()
    in_f32 = re.search(r"= f32\[64,64\]", text) is not None
    return dataclasses.replace(XLA_CPU_MEMORY, narrow_dots_in_f32=in_f32)


def _runs_on_cpu(mesh) -> bool:
    """Will the plan be compiled by XLA:CPU (the mesh's devices, else JAX's default
    backend)? Its memory layout differs (:func:`xla_cpu_memory_layout`)."""
    import jax

    if hasattr(mesh, "devices") and hasattr(mesh.devices, "flat"):
        return all(d.platform == "cpu" for d in mesh.devices.flat)
    return jax.default_backend() == "cpu"


def auto_shard(
    fn,
    *example_args,
    mesh,
    options: IntraOptions | None = None,
    arg_kinds=("param", "opt_state", "data"),
    aliases=None,
    baseline: str | None = None,
    check_compiled_memory: bool = True,
    cluster=None,
    offload=None,
    progress=None,
):
    """Plan ``fn(*example_args)`` on ``mesh`` with Alpa's intra-operator ILP.

    ``example_args`` are pytrees of ``jax.ShapeDtypeStruct`` (or arrays). By default the
    function is a training step ``(params, opt_state, batch) -> (params, opt_state, loss)``;
    pass ``arg_kinds``/``aliases`` for other signatures. ``options``
    (:class:`~autoshard.intra.problem.options.IntraOptions`) holds the planner's settings: solver,
    time limit, memory budget (``memory_budget_bytes``, bytes per device), merging, layer
    sharing and Alpa's knobs. With a budget and ``check_compiled_memory`` (the default) the
    plan is compiled and re-planned until XLA's peak fits it (:func:`fit_compiled_budget`).
    With ``cluster`` the preset's HBM per device is the default budget, and the budget
    bounds the predicted peak only (compiling here is not the GPU's compile); the plan's
    notes say so, and a model that cannot fit raises InfeasibleBudgetError with the least
    peak any plan reaches. ``baseline`` ("dp", "zero2", "zero3", "megatron") pins the inputs the way
    that baseline does and lets the ILP place the rest; "heuristic" also splits every
    operator's largest output dim (Alpa's shard-the-largest-dimension baseline).
    ``offload`` (with ``cluster``; :mod:`autoshard.intra.offload.placement`): ``None`` or ``"none"``,
    a placement (``"optimizer"``, ``"optimizer,master"``, ``"optimizer,master,gradients"``
    or an :class:`~autoshard.intra.offload.placement.Offload`), or ``"auto"``: the cheapest placement
    that fits the HBM and the host's memory when the plan alone does not
    (:func:`autoshard.intra.offload.search.plan_with_offload`); the plan's ``offload``
    record and notes say what lives where and what it costs. ``progress``
    (:class:`~autoshard.inter.progress.Progress`; default: lines on stderr) hears when a
    budget binds, before the slow solves under it.

    Returns a :class:`BoundPlan`: the jax-free :class:`~autoshard.ir.plan.ParallelPlan`
    (``.plan``) with the traced program, so ``.jit()`` gives the sharded callable and
    ``.verify()`` the predicted-vs-compiled report.
    """
    from autoshard.intra.baselines.tables import baseline_inputs, baseline_options
    from autoshard.intra.ilp import InfeasibleBudgetError, InfeasibleProblemError
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.trace.jaxpr import trace

    if progress is None:
        from autoshard.inter.progress import Progress

        progress = Progress("plan")
    if aliases is None and tuple(arg_kinds)[:2] == ("param", "opt_state"):
        aliases = {0: 0, 1: 1}
    program = trace(fn, *example_args, arg_kinds=arg_kinds, aliases=aliases)
    graph = build_graph(program.records)
    dmesh = device_mesh_for(mesh, cluster=cluster)
    pinned = baseline_inputs(graph, dmesh.mesh, baseline) if baseline else None
    options = options if options is not None else IntraOptions()
    if baseline:  # dp and megatron keep every activation split over their data axes
        options = baseline_options(options, dmesh.mesh, baseline)
    options, notes = cluster_memory_budget(options, dmesh, cluster)
    offload = _offload_request(offload, baseline, cluster, options)
    try:
        if options.memory_budget_bytes is not None and offload is None:
            # (offloaded state is not in the device's memory: its plans are checked there)
            refuse_budget_below_the_state(graph, dmesh, options.memory_budget_bytes)
        plan = None
        if offload is not None:
            plan = _plan_offloaded(graph, dmesh, options, pinned, baseline, cluster, offload)
        elif options.memory_budget_bytes is not None:
            # plan without the budget first: a budget makes the ILP list every resharded
            # copy (slow and large), and the unbudgeted optimum, when predicted to fit, is
            # the budgeted optimum too (it is feasible there, and nothing there is cheaper);
            # solve again under the budget only when it binds
            # (a budget every plan provably peaks over is refused before this solve)
            free = auto_shard_graph(
                graph,
                dmesh,
                options.replace(memory_budget_bytes=None),
                pinned_inputs=pinned,
                name=baseline or "auto",
                refuse_over=options.memory_budget_bytes,
            )
            if free.predicted_peak_bytes <= options.memory_budget_bytes:
                plan = free
            else:
                plan = plan_under_binding_budget(
                    graph, dmesh, options, pinned, baseline, free, progress
                )
        if plan is None:
            plan = auto_shard_graph(
                graph, dmesh, options, pinned_inputs=pinned, name=baseline or "auto"
            )
    except InfeasibleProblemError as err:
        strict = options.data_parallel_axes or options.keep_weight_layout
        if baseline and strict:  # say where the baseline's layout rules break
            _refuse_baseline(graph, dmesh, options, pinned, baseline, err)
        raise
    except InfeasibleBudgetError as err:
        if notes:  # the budget is the device's memory: say so, with the least a plan needs
            err.args = (
                f"the plan cannot fit the device ({notes[0]}): {err}; or pass a larger "
                "memory budget (--memory-budget GiB) to plan past the device's memory",
            )
        raise
    if notes:
        plan = dataclasses.replace(plan, notes=plan.notes + notes)
    # as JSON holds them (tuples become lists), so a loaded plan file's options compare equal
    options_json = json.loads(json.dumps(dataclasses.asdict(options)))
    made_for = {"options": options_json, "cluster": _cluster_name(cluster)}
    bound = BoundPlan(
        plan, program, graph, mesh if hasattr(mesh, "devices") else None, made_for=made_for
    )
    if cluster is not None:  # XLA:CPU's compile is not the GPU's: the budget bounds the prediction
        check_compiled_memory = False
    if options.memory_budget_bytes is not None and check_compiled_memory:
        bound = fit_compiled_budget(bound, dmesh, options, pinned=pinned)
    return bound


def _offload_request(offload, baseline, cluster, options):
    """None (no offload) or what :func:`~autoshard.intra.offload.search.plan_with_offload`
    takes, checked: a cluster with a host section, a baseline that allows it, a budget."""
    from autoshard.hardware.clusters import Cluster, load_cluster
    from autoshard.intra.offload.placement import Offload, parse_offload
    from autoshard.intra.offload.search import check_offload_request

    if offload is None:
        return None
    request = offload if isinstance(offload, Offload) else parse_offload(offload)
    if request != "auto" and not request:
        return None
    if options.offload:
        raise ValueError("give offload= or IntraOptions(offload=...), not both")
    loaded = cluster if cluster is None or isinstance(cluster, Cluster) else load_cluster(cluster)
    check_offload_request(request, baseline, loaded)
    if options.memory_budget_bytes is None:
        raise ValueError("offload plans against a memory budget: give one, or a cluster preset")
    return request


def _plan_offloaded(graph, dmesh, options, pinned, baseline, cluster, offload):
    """The plan with ``offload`` (``"auto"``: plain first, when it fits the budget)."""
    from autoshard.hardware.clusters import Cluster, load_cluster
    from autoshard.intra.ilp import InfeasibleBudgetError
    from autoshard.intra.offload.search import plan_with_offload
    from autoshard.intra.problem.build import auto_shard_graph

    name = baseline or "auto"
    loaded = cluster if isinstance(cluster, Cluster) else load_cluster(cluster, dmesh.num_devices)
    fits = None
    if offload == "auto":  # the plain plan, when it fits, costs no transfers
        # unbudgeted first (fast: no memory rows), then under the budget (it may shard
        # the state instead), as without offload
        free = auto_shard_graph(
            graph, dmesh, options.replace(memory_budget_bytes=None), pinned_inputs=pinned,
            name=name,
        )  # fmt: skip
        if free.predicted_peak_bytes <= options.memory_budget_bytes:
            fits = free
        else:
            try:
                fits = auto_shard_graph(graph, dmesh, options, pinned_inputs=pinned, name=name)
            except InfeasibleBudgetError:
                fits = None
    return plan_with_offload(
        graph, dmesh, options, offload, loaded, pinned=pinned, name=name, fits_plan=fits
    )


@dataclass(frozen=True)
class BoundPlan:
    """A plan together with the program it was made for."""

    plan: object  # ParallelPlan
    program: TracedProgram
    graph: Graph
    jax_mesh: object = None
    report: object = None  # the VerificationReport, when planning already compiled the plan
    # what the plan was made for, beyond the program and mesh: model, overrides,
    # optimizer, options, cluster (the keywords of ``make_fingerprint``)
    made_for: dict | None = None

    def plan_file(self):
        """The plan with its fingerprint (:class:`~autoshard.ir.planfile.PlanFile`)."""
        from autoshard.ir.planfile import PlanFile, input_table, make_fingerprint

        fp = make_fingerprint(self.graph, self.plan.mesh, **(self.made_for or {}))
        return PlanFile(self.plan, fp, inputs=input_table(self.graph))

    def save(self, path) -> None:
        """Write the plan file (``autoshard run --plan`` and :func:`bind_plan` read it)."""
        self.plan_file().save(path)

    def mesh(self, devices=None):
        from autoshard.runtime.sharded import make_mesh

        return self.jax_mesh if self.jax_mesh is not None else make_mesh(self.plan.mesh, devices)

    def jit(self, devices=None, donate: bool = True):
        """The sharded, jitted step (``ShardedStep``: call it, ``.lower()``, ``.compile()``)."""
        from autoshard.runtime.sharded import build_sharded_step

        return build_sharded_step(self.program, self.plan, self.mesh(devices), donate=donate)

    def verify(self, devices=None, target=None, **kw):
        """Predicted vs compiled collectives and memory (:class:`VerificationReport`);
        compiled once: the memory-budget loop's report is reused when it has one.
        ``target`` ("cpu", "gpu-aot", "gpu-aot:1x1x8"; :mod:`autoshard.runtime.targets`)
        compiles on that target's devices instead of this process's."""
        from autoshard.verify.check import verify_plan

        if self.report is not None and devices is None and target is None and not kw:
            return self.report
        if target is not None:  # the target's devices, not the bound mesh
            from autoshard.runtime.sharded import make_mesh
            from autoshard.runtime.targets import target_devices

            if devices is None:
                devices = target_devices(target, self.plan.mesh.num_devices)
            mesh = make_mesh(self.plan.mesh, devices)
            return verify_plan(self.program, self.plan, mesh, target=target, **kw)
        return verify_plan(self.program, self.plan, self.mesh(devices), **kw)


def plan_workload(
    workload: Workload | str,
    mesh,
    *,
    optimizer: str = "adamw",
    baseline: str | None = None,
    options: IntraOptions | None = None,
    cluster=None,
    offload=None,
    progress=None,
    **overrides,
):
    """``auto_shard`` for a preset model's training step (abstract shapes); ``overrides``
    change the preset's sizes (``num_layers=2``, ``batch_size=8``, ...); ``offload`` as in
    :func:`auto_shard`."""
    if isinstance(workload, str):
        workload = get_workload(workload, **overrides)
    opt = make_optimizer(optimizer)
    step = make_train_step(workload.loss_fn, opt)
    try:
        bound = auto_shard(
            step,
            *workload.abstract_train_args(opt),
            mesh=mesh,
            baseline=baseline,
            options=options,
            cluster=cluster,
            offload=offload,
            progress=progress,
        )
    except BaselineRefusedError as err:  # the model may say which sizes would work
        hint = getattr(workload.config, "data_parallel_hint", None)
        if hint is not None and (line := hint(err.devices)) is not None:
            err.args = (f"{workload.name}: {line}. {err}",)
        raise
    made_for = dict(bound.made_for or {}, model=workload.name, optimizer=optimizer)
    made_for["overrides"] = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(bound, made_for=made_for)


def _cluster_name(cluster) -> str | None:
    if cluster is None or isinstance(cluster, str):
        return cluster
    return str(getattr(cluster, "name", cluster))


def bind_plan(plan_file, mesh=None) -> BoundPlan:
    """A saved plan (a path or a :class:`~autoshard.ir.planfile.PlanFile`) bound to its
    program, re-traced from the model preset, sizes and optimizer the file names.

    Nothing is solved again. Raises PlanFileError (a ValueError) when the file names no
    model, or the re-traced program or ``mesh`` (a jax mesh, optional) is not the one the
    plan was made for.
    """
    from autoshard.ir.planfile import PlanFileError, check_fingerprint, load_plan, require_one_mesh
    from autoshard.ir.spec import Mesh

    pf = plan_file if hasattr(plan_file, "fingerprint") else load_plan(plan_file)
    require_one_mesh(pf)
    if not pf.model:
        raise PlanFileError(
            "the plan file names no model preset (it was saved from auto_shard on your own "
            "function): bind it in Python with BoundPlan(plan, program, graph)"
        )
    traced = trace_workload(pf.model, pf.optimizer or "adamw", **pf.overrides)
    logical = None
    if mesh is not None:
        shape = tuple(int(s) for s in mesh.devices.shape)
        logical = Mesh(tuple(mesh.axis_names), shape)
    check_fingerprint(pf, traced.graph, logical)
    made_for = {k: pf.fingerprint.get(k) for k in ("model", "optimizer", "options", "cluster")}
    made_for["overrides"] = pf.overrides
    return BoundPlan(pf.plan, traced.program, traced.graph, mesh, made_for=made_for)
