"""Verify a plan against what XLA compiled: collectives and peak memory, side by side.

Takes a traced program and a :class:`~autoshard.ir.plan.ParallelPlan`, compiles the
sharded step with abstract inputs (``jax.ShapeDtypeStruct`` with shardings, so large
models need no memory), parses the compiled HLO into collectives
(:mod:`autoshard.verify.collectives`; :mod:`autoshard.verify.xla_cpu` normalises XLA:CPU's
all-reduce + dynamic-slice into reduce-scatter and its bf16 -> f32 upcasts) and reads
``memory_analysis()``.  Returns a :class:`VerificationReport` that says whether prediction
and compilation agree:

* collectives -- the same (kind, mesh axes) pairs on both sides, and total bytes per pair
  within ``bytes_rtol`` (2%);
* memory -- predicted peak bytes per device within ``memory_rtol`` (10%) of XLA's
  allocation (arguments + outputs - aliases + temp).

Where memory disagrees, the step is compiled a second time with an XLA dump into a
temporary folder, and XLA's live peak -- the most bytes its schedule holds live at once,
computed from its live-range and buffer-assignment dumps
(:func:`~autoshard.verify.memory.live_range_peak`) -- is recorded next to the allocation, with
the instruction where it is reached.  When the prediction is within ``memory_rtol`` of that
live peak and the allocation is above it, the disagreement is explained: XLA's heap holds
gaps above its live peak (fragmentation), which no liveness model predicts.  Otherwise the
model misses (or adds) live buffers, and the instruction says where to look.
``memory_agree`` and ``agree`` stay allocation-based; ``memory_explained_by_heap_gap``
says the disagreement is a heap gap.
"""

from __future__ import annotations

import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from autoshard.ir.plan import ParallelPlan
from autoshard.ir.spec import Collective
from autoshard.verify.collectives import analyze_collectives
from autoshard.verify.compare import CollectiveComparison, compare_collectives
from autoshard.verify.memory import (
    LIVE_RANGE_DUMP_OPTIONS,
    LivePeak,
    MemoryStats,
    dump_live_peak,
    memory_stats,
)


@dataclass(frozen=True)
class VerificationReport:
    plan: str
    mesh: str
    comparison: CollectiveComparison
    compiled_collectives: tuple[Collective, ...]
    compiled_notes: tuple[str, ...]
    predicted_peak_bytes: float
    memory: MemoryStats
    memory_rtol: float
    compile_seconds: float
    # XLA's live-range peak (bytes live at once), measured only where memory disagrees;
    # None when not measured or unknown, and live_peak_note says why
    compiled_live_peak_bytes: float | None = None
    compiled_live_peak_instruction: str = ""  # where XLA's schedule reaches it
    live_peak_note: str = ""
    # what it was compiled for: "cpu" (this process's devices) or "gpu-aot:1x1x8", and
    # the devices in words (autoshard.runtime.targets)
    target: str = "cpu"
    devices: str = ""
    # the compiled HLO text, kept only with verify_plan(..., keep_hlo=True)
    hlo_text: str = field(default="", repr=False, compare=False)
    # on a GPU target: XLA:GPU's rewrites applied to the plan's predicted collectives
    # before comparing (autoshard.verify.xla_gpu), one note each
    prediction_notes: tuple[str, ...] = ()

    @property
    def compiled_peak_bytes(self) -> float:
        """Arguments + outputs - donated (aliased) + XLA's temp buffer.

        XLA:CPU's ``peak_memory_in_bytes`` leaves its temp buffer out (it reports
        arguments + outputs - aliases), so we add it back: the temp buffer holds every
        intermediate, packed by XLA's heap simulator.
        """
        return float(_allocated(self.memory))

    @property
    def memory_error(self) -> float:
        c = self.compiled_peak_bytes
        return abs(self.predicted_peak_bytes - c) / max(c, 1.0)

    @property
    def collectives_agree(self) -> bool:
        return self.comparison.agree

    @property
    def memory_agree(self) -> bool:
        return self.memory_error <= self.memory_rtol

    @property
    def agree(self) -> bool:
        return self.collectives_agree and self.memory_agree

    @property
    def live_peak_error(self) -> float | None:
        """Signed (predicted - live peak) / live peak; None when the live peak is unknown."""
        live = self.compiled_live_peak_bytes
        if live is None or live <= 0:
            return None
        return (self.predicted_peak_bytes - live) / live

    @property
    def heap_gap_bytes(self) -> float | None:
        """What XLA allocates above the bytes it holds live at its peak (None: unknown)."""
        live = self.compiled_live_peak_bytes
        return None if live is None else self.compiled_peak_bytes - live

    @property
    def memory_explained_by_heap_gap(self) -> bool:
        """The memory disagreement is a heap gap: the prediction misses XLA's allocation by
        more than ``memory_rtol`` but is within ``memory_rtol`` of XLA's live peak, and the
        allocation is above that peak.  False where memory agrees or the live peak is
        unknown.  ``memory_agree`` and ``agree`` do not change."""
        error = self.live_peak_error
        return (
            not self.memory_agree
            and error is not None
            and abs(error) <= self.memory_rtol
            and self.compiled_peak_bytes > self.compiled_live_peak_bytes
        )

    @property
    def memory_explanation(self) -> str:
        """One sentence on a memory disagreement ("" where memory agrees)."""
        if self.memory_agree:
            return ""
        live, gap, error = self.compiled_live_peak_bytes, self.heap_gap_bytes, self.live_peak_error
        if live is None or error is None:
            return f"XLA's live peak is unknown ({self.live_peak_note or 'not measured'})"
        if gap > 0:
            held = (
                f"XLA's heap holds {_mib(gap)} above its live peak {_mib(live)} "
                f"(allocation {_mib(self.compiled_peak_bytes)})"
            )
        else:
            held = (
                f"XLA's live peak {_mib(live)} is not below its allocation "
                f"{_mib(self.compiled_peak_bytes)}"
            )
        if self.memory_explained_by_heap_gap:
            return (
                f"{held}; the prediction is within {self.memory_rtol:.0%} of the live peak "
                f"({error:+.1%}), so the gap is heap fragmentation the liveness model does "
                "not predict"
            )
        where = self.compiled_live_peak_instruction
        return (
            f"{held}; the prediction is {error:+.1%} off the live peak, outside "
            f"{self.memory_rtol:.0%}: not only a heap gap, the model "
            f"{'misses' if error < 0 else 'adds'} live buffers"
            + (f" (XLA's peak is at {where})" if where else "")
        )

    def to_json(self) -> dict:
        return {
            "plan": self.plan,
            "mesh": self.mesh,
            "target": self.target,
            "devices": self.devices,
            "predicted_collectives": [
                {
                    "kind": r.kind,
                    "axes": list(r.axes),
                    "count": r.predicted_count,
                    "bytes": r.predicted_bytes,
                }
                for r in self.comparison.rows
                if r.predicted_count
            ],
            "compiled_collectives": [
                {
                    "kind": r.kind,
                    "axes": list(r.axes),
                    "count": r.compiled_count,
                    "bytes": r.compiled_bytes,
                }
                for r in self.comparison.rows
                if r.compiled_count
            ],
            "collectives_agree": self.collectives_agree,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "compiled_peak_bytes": self.compiled_peak_bytes,
            "compiled_memory": {
                "argument_bytes": self.memory.argument_bytes,
                "output_bytes": self.memory.output_bytes,
                "temp_bytes": self.memory.temp_bytes,
                "alias_bytes": self.memory.alias_bytes,
            },
            "memory_error": self.memory_error,
            "memory_agree": self.memory_agree,
            "compiled_live_peak_bytes": self.compiled_live_peak_bytes,
            "compiled_live_peak_instruction": self.compiled_live_peak_instruction,
            "live_peak_error": self.live_peak_error,
            "live_peak_note": self.live_peak_note,
            "memory_explained_by_heap_gap": self.memory_explained_by_heap_gap,
            "memory_explanation": self.memory_explanation,
            "agree": self.agree,
            "compile_seconds": self.compile_seconds,
            "notes": list(self.compiled_notes),
            "prediction_notes": list(self.prediction_notes),
        }


LIVE_PEAK_WHEN = ("on_disagreement", "always", "never")


def compiled_hlo_text(compiled) -> str:
    """The compiled module's text as ``compiled.as_text()`` prints it, but with large
    constants written out: ``as_text`` elides any literal past a few elements as
    ``{...}``, and on 64 or more devices the table of each device's slice offset (an
    all-reduce + dynamic-slice read as a reduce-scatter) is such a literal. Falls back to
    ``as_text()`` where the executable's modules cannot be had (an older jaxlib)."""
    try:
        from jaxlib import _hlo

        options = _hlo.HloPrintOptions()  # as_text's options
        options.print_large_constants = True
        modules = compiled.runtime_executable().hlo_modules()
        return "\n\n".join(m.to_string(options) for m in modules)
    except (ImportError, AttributeError, RuntimeError, TypeError):
        return compiled.as_text()


def verify_plan(
    program,
    plan: ParallelPlan,
    mesh=None,
    *,
    devices=None,
    target=None,
    bytes_rtol: float = 0.02,
    memory_rtol: float = 0.10,
    live_peak: str = "on_disagreement",
    keep_hlo: bool = False,
) -> VerificationReport:
    """Compile ``plan`` for ``program`` and compare its predictions with XLA's.

    Where it compiles: ``mesh`` (a ``jax.sharding.Mesh``), else ``devices``, else
    ``target`` (:mod:`autoshard.runtime.targets`): ``"cpu"`` (default: this process's
    devices) or ``"gpu-aot"`` / ``"gpu-aot:1x1x8"`` (XLA:GPU ahead of time on compile-only
    GPUs; needs a CUDA jaxlib and one GPU, else TargetUnavailableError, a ValueError).
    ``keep_hlo`` keeps the compiled HLO text in the report (``hlo_text``).

    ``live_peak`` says when to compile the step a second time with an XLA dump (a
    temporary folder, removed after) to read XLA's live peak
    (:func:`measure_live_peak`): ``"on_disagreement"`` (where the memory prediction is
    outside ``memory_rtol``), ``"always"`` or ``"never"``."""
    if live_peak not in LIVE_PEAK_WHEN:
        raise ValueError(f"live_peak must be one of {LIVE_PEAK_WHEN}, got {live_peak!r}")
    import numpy as np

    from autoshard.runtime.sharded import abstract_args, build_sharded_step, make_mesh
    from autoshard.runtime.targets import describe_devices, parse_target, target_devices

    compile_target = parse_target(target)
    if compile_target.kind == "gpu-aot":  # name the topology it was sized to
        topology = compile_target.topology_for(plan.mesh.num_devices)
        compile_target = replace(compile_target, topology=topology)
    if mesh is None and devices is None and target is not None:
        devices = target_devices(compile_target, plan.mesh.num_devices)
    jmesh = mesh if mesh is not None else make_mesh(plan.mesh, devices)
    step = build_sharded_step(program, plan, jmesh, donate=True)
    start = time.perf_counter()
    compiled = step.lower(*abstract_args(program, plan, jmesh)).compile()
    seconds = time.perf_counter() - start
    flat_devices = list(np.asarray(jmesh.devices).flat)
    device_ids = [d.id for d in flat_devices]
    text = compiled_hlo_text(compiled)
    parsed = analyze_collectives(text, plan.mesh, device_ids)
    collectives = parsed.compared()  # collective-permutes included
    notes = tuple(sorted({c.note for c in parsed.collectives if c.note}))
    on_gpu = compile_target.kind == "gpu-aot" or _platform_target(flat_devices) == "gpu"
    predicted, prediction_notes = plan.predicted_collectives, ()
    if on_gpu:  # XLA:GPU folds and reassociates all-reduces that XLA:CPU keeps
        from autoshard.ir.graph import build_graph
        from autoshard.verify.xla_gpu import xla_gpu_collectives

        gpu = xla_gpu_collectives(build_graph(program.records), plan)
        predicted, prediction_notes = gpu.collectives, gpu.notes
    comparison = compare_collectives(predicted, collectives, rel_tol=bytes_rtol)
    report = VerificationReport(
        plan=plan.name,
        mesh=str(plan.mesh),
        comparison=comparison,
        compiled_collectives=collectives,
        compiled_notes=notes,
        predicted_peak_bytes=plan.predicted_peak_bytes,
        memory=memory_stats(compiled),
        memory_rtol=memory_rtol,
        compile_seconds=seconds,
        target=str(compile_target) if target is not None else _platform_target(flat_devices),
        devices=describe_devices(flat_devices),
        hlo_text=text if keep_hlo else "",
        prediction_notes=prediction_notes,
    )
    if live_peak == "never":
        return replace(report, live_peak_note="not measured (live_peak='never')")
    if live_peak == "on_disagreement" and report.memory_agree:
        return replace(report, live_peak_note="not measured: memory agrees")
    peak, note = measure_live_peak(step, abstract_args(program, plan, jmesh), report.memory)
    if peak is None:
        return replace(report, live_peak_note=note)
    return replace(
        report,
        compiled_live_peak_bytes=float(peak.bytes),
        compiled_live_peak_instruction=peak.instruction,
        live_peak_note=note,
    )


def measure_live_peak(step, args, memory: MemoryStats | None = None) -> tuple[LivePeak | None, str]:
    """XLA's live peak of ``step`` (a jitted function) on ``args``: compiles it again with
    an XLA dump into a temporary folder (removed after) and reads the dumps
    (:func:`~autoshard.verify.memory.dump_live_peak`).

    Returns ``(peak, note)``: ``peak`` is None when it is unknown -- no live-range or
    buffer-assignment file (another backend or XLA version), a format the parser does not
    read, a failing compile, or, given the first compile's ``memory``, a dumped compile
    that allocates differently (its live peak would describe another executable).  The
    note says which, or where the peak is.  Never raises.
    """
    try:
        with tempfile.TemporaryDirectory(prefix="autoshard-xla-dump-") as folder:
            options = {"xla_dump_to": folder, **LIVE_RANGE_DUMP_OPTIONS}
            with _past_the_persistent_cache(options, folder):
                compiled = step.lower(*args).compile(compiler_options=options)
            live = dump_live_peak(folder)
    except Exception as exc:  # any failure leaves the live peak unknown, never the report
        first_line = (str(exc).strip().splitlines() or [""])[0][:200]
        return None, f"unknown: the dumped compile failed ({type(exc).__name__}: {first_line})"
    if live is None:
        return None, "unknown: XLA wrote no readable live-range and buffer-assignment dumps"
    if memory is not None:
        again = memory_stats(compiled)
        if again != memory:
            return None, (
                "unknown: the dumped compile allocates differently "
                f"({_mib(_allocated(again))} vs {_mib(_allocated(memory))})"
            )
    return live, (
        f"XLA's dumps: most bytes live at once, at {live.instruction or '?'} "
        f"(position {live.position} of its schedule)"
    )


@contextmanager
def _past_the_persistent_cache(options: dict, folder: str):
    """Compile past JAX's persistent compilation cache, when one is set
    (``JAX_COMPILATION_CACHE_DIR``): jax leaves the ``xla_dump_*`` options out of its cache
    key, so the dumped compile would load the first compile's entry and XLA would write no
    dumps. A key of its own (an option that only names a folder for GPU autotuning
    results, this call's temporary folder: inert on the CPU, a file in a folder removed
    after on a GPU) makes it compile; the entry is not written (the minimum compile time
    to cache raised for the call), so the cache does not fill with keys never read again.
    """
    import jax

    if not jax.config.jax_compilation_cache_dir:
        yield
        return
    options["xla_gpu_dump_autotune_results_to"] = folder
    name = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, name)
    jax.config.update(name, float("inf"))
    try:
        yield
    finally:
        jax.config.update(name, before)


def _platform_target(devices) -> str:
    """ "cpu" for CPU devices; a mesh of other devices is named by their platform."""
    platform = getattr(devices[0], "platform", "cpu")
    return "cpu" if platform == "cpu" else platform


def _allocated(m: MemoryStats) -> int:
    return m.argument_bytes + m.output_bytes - m.alias_bytes + m.temp_bytes


def _mib(nbytes: float) -> str:
    from autoshard.ir.units import format_bytes

    return format_bytes(nbytes)
