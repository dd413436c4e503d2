"""Pictures of a plan, as PNG bytes (jax-free; matplotlib's Agg backend, no display).

Takes a :class:`~autoshard.report.digest.PlanDigest`; returns :class:`Pictures`, PNGs
by name:

* ``mesh``: the device mesh, one cell per device (its id and coordinates), coloured by
  pipeline stage, each axis labelled with its role;
* ``timeline``: the pipeline schedule as a Gantt chart per stage (forward, backward,
  the optimizer update; idle ticks are the bubble), in schedule ticks (a forward is one
  tick, a backward two: the usual ratio, not a measurement); only for plans of more than
  one stage (a one-stage plan's would be three fixed-width bars: the order of the
  phases, which says nothing about the plan and read like a profile);
* ``memory``: bytes per device of each layer's weights, gradients and optimizer state,
  stacked bars, and a bar of the rest of the predicted peak (activations, temporaries and
  data: they belong to no one layer);
* ``tensor``: which device holds which block of one tensor (the largest parameter, or
  the one ``tensor=`` names by regex), over its first two dimensions.

Devices are numbered row-major over the mesh shape, as ``autoshard.runtime.sharded.
make_mesh`` lays them out.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autoshard.inter.schedules import BACKWARD, one_f_one_b
from autoshard.ir.units import format_bytes
from autoshard.report.digest import PlanDigest, layer_of, short_path

STAGE_COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860")
PHASE_COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "update": "#55A868"}


@dataclass(frozen=True)
class Pictures:
    """PNG bytes by picture name (module docstring)."""

    png: dict[str, bytes]
    tensor_path: str  # the tensor the ``tensor`` picture shows

    def save(self, folder) -> list[str]:
        """Write ``<name>.png`` for each picture into ``folder`` (made if missing)."""
        out = Path(folder)
        try:
            out.mkdir(parents=True, exist_ok=True)
            paths = []
            for name, data in self.png.items():
                path = out / f"{name}.png"
                path.write_bytes(data)
                paths.append(str(path))
        except OSError as err:
            raise ValueError(
                f"cannot write pictures into {str(folder)!r}: {err.strerror}"
            ) from None
        return paths


def _figure(width: float, height: float):
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=(width, height), dpi=110)


def _png(plt, fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _grid_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 1:
        return 1, shape[0]
    return int(np.prod(shape[:-1])), shape[-1]


def _role(d: PlanDigest, axis: str) -> str:
    roles = d.parallelism
    if axis in roles.dp_axes:
        return "data parallel"
    if axis in roles.tp_axes:
        return "tensor parallel"
    return "replicated" if d.mesh.size(axis) > 1 else "size 1"


def mesh_picture(d: PlanDigest) -> bytes:
    mesh = d.mesh
    rows, cols = _grid_shape(mesh.shape)
    plt, fig, ax = _figure(1.2 + 1.1 * cols, 1.2 + 0.9 * rows)
    stage_of = np.zeros(mesh.num_devices, dtype=int)  # one stage: every device in stage 0
    for dev in range(mesh.num_devices):
        r, c = divmod(dev, cols)
        coords = np.unravel_index(dev, mesh.shape)
        colour = STAGE_COLOURS[stage_of[dev] % len(STAGE_COLOURS)]
        ax.add_patch(plt.Rectangle((c, rows - 1 - r), 0.92, 0.88, color=colour, alpha=0.85))
        ax.text(c + 0.46, rows - 1 - r + 0.55, f"dev {dev}", ha="center", color="white",
                fontsize=10, weight="bold")  # fmt: skip
        ax.text(c + 0.46, rows - 1 - r + 0.22, str(tuple(int(x) for x in coords)),
                ha="center", color="white", fontsize=8)  # fmt: skip
    ax.set_xlim(-0.1, cols + 0.1)
    ax.set_ylim(-0.1, rows + 0.1)
    ax.set_xticks([])
    ax.set_yticks([])
    last = mesh.axis_names[-1]
    ax.set_xlabel(f"{last} ({mesh.size(last)}): {_role(d, last)}")
    if len(mesh.shape) > 1:
        inner = ", ".join(f"{a} ({mesh.size(a)}): {_role(d, a)}" for a in mesh.axis_names[:-1])
        ax.set_ylabel(inner)
    stages = d.parallelism.num_stages
    ax.set_title(f"mesh {'x'.join(map(str, mesh.shape))}, coloured by stage ({stages} stage"
                 f"{'s' if stages > 1 else ''})")  # fmt: skip
    return _png(plt, fig)


def timeline_picture(d: PlanDigest, microbatches: int = 1) -> bytes:
    stages = d.parallelism.num_stages
    schedule = one_f_one_b(stages, microbatches)
    plt, fig, ax = _figure(7.5, 1.2 + 0.6 * stages)
    clock = 0
    end = np.zeros(stages)
    for tick in schedule:
        width = max((2 if t.kind == BACKWARD else 1) for t in tick)
        for t in tick:
            w = 2 if t.kind == BACKWARD else 1
            ax.barh(t.stage, w, left=clock, color=PHASE_COLOURS[t.kind], edgecolor="white")
            ax.text(clock + w / 2, t.stage, f"{t.kind[0].upper()}{t.microbatch}", ha="center",
                    va="center", color="white", fontsize=8)  # fmt: skip
            end[t.stage] = clock + w
        clock += width
    for s in range(stages):
        ax.barh(s, 0.5, left=clock, color=PHASE_COLOURS["update"], edgecolor="white")
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.invert_yaxis()
    if stages == 1:  # no pipeline: the order of the step's phases, not a profile
        ax.set_xlabel("phases in order (schedule ticks, not measured times)")
    else:
        ax.set_xlabel("time (schedule ticks: forward 1, backward 2, update 0.5; idle = bubble)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in PHASE_COLOURS.values()]
    ax.legend(handles, list(PHASE_COLOURS), loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize=8)  # fmt: skip
    ax.set_title(
        "one stage, no pipeline: forward, backward, update"
        if stages == 1
        else f"pipeline timeline: {stages} stages, {microbatches} microbatch(es), 1F1B"
    )
    return _png(plt, fig)


def memory_by_layer(d: PlanDigest) -> dict[str, dict[str, float]]:
    """Bytes per device by layer and category (weights, gradients, optimizer state), and
    a ``(whole step)`` row with what belongs to no one layer (activations and
    temporaries, data). Gradients are counted like the weights (under ZeRO-2/3 they are
    split further); otherwise the rows add up to the predicted peak, less the optimizer's
    step counters."""
    mesh = d.mesh
    per_layer: dict[str, dict[str, float]] = {}
    for inp, spec in d.specs():
        if inp.kind not in ("param", "opt_state"):
            continue
        layer = layer_of(inp.path)
        if inp.kind == "opt_state":
            m = re.search(r"\['([^']+)'\]", inp.path)
            if m is None:
                continue  # a counter, not a layer's state
        row = per_layer.setdefault(
            layer, {"weights": 0.0, "gradients": 0.0, "optimizer state": 0.0}
        )
        nbytes = inp.nbytes * spec.shard_fraction(mesh)
        if inp.kind == "param":
            row["weights"] += nbytes
            row["gradients"] += nbytes
        else:
            row["optimizer state"] += nbytes
    # the rest of the predicted peak belongs to no one layer: one bar of its own
    rest = {k: d.memory_bytes.get(k, 0.0) for k in ("activations and temporaries", "data")}
    zero = {"weights": 0.0, "gradients": 0.0, "optimizer state": 0.0}
    per_layer["(whole step)"] = {**zero, **rest}
    return per_layer


def _binary_unit(nbytes: float) -> tuple[str, float]:
    """The binary unit a size is written in (:func:`autoshard.ir.units.format_bytes`)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return unit, float(scale)
    return "B", 1.0


def memory_picture(d: PlanDigest) -> bytes:
    per_layer = memory_by_layer(d)
    names = list(per_layer)
    plt, fig, ax = _figure(max(6.5, 1.5 + 0.8 * len(names)), 4.0)
    bottom = np.zeros(len(names))
    colours = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3")
    categories = ("weights", "gradients", "optimizer state", "activations and temporaries",
                  "data")  # fmt: skip
    unit, scale = _binary_unit(max(d.plan.predicted_peak_bytes, 1.0))
    for colour, cat in zip(colours, categories):
        vals = np.array([per_layer[n].get(cat, 0.0) for n in names]) / scale
        ax.bar(names, vals, bottom=bottom, label=cat, color=colour)
        bottom += vals
    ax.set_ylim(0, max(float(bottom.max()), 1e-3) * 1.15)  # room above the tallest bar
    ax.set_ylabel(f"{unit} per device")
    ax.set_title(
        f"memory per device: each layer's state, and the rest of the predicted peak "
        f"({format_bytes(d.plan.predicted_peak_bytes)} in all)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    return _png(plt, fig)


def _chosen(d: PlanDigest, tensor: str | None):
    rows = [(i, s) for i, s in d.specs() if i.shape and i.kind in ("param", "opt_state", "data")]
    if tensor is not None:
        rows = [(i, s) for i, s in rows if re.search(tensor, i.path)] or rows
        return rows[0]
    for kind in ("param", "opt_state"):  # the largest split parameter, else state
        split = [(i, s) for i, s in rows if i.kind == kind and not s.is_replicated]
        if split:
            return max(split, key=lambda r: r[0].nbytes)
    return max(rows, key=lambda r: r[0].nbytes)


def tensor_picture(d: PlanDigest, tensor: str | None = None) -> tuple[bytes, str]:
    mesh = d.mesh
    inp, spec = _chosen(d, tensor)
    dims = spec.dims[:2] if len(spec.dims) >= 2 else (spec.dims[0], ())
    nrow, ncol = mesh.size(dims[0]), mesh.size(dims[1])
    holders: dict[tuple[int, int], list[int]] = {}
    for dev in range(mesh.num_devices):
        coords = dict(zip(mesh.axis_names, np.unravel_index(dev, mesh.shape)))
        idx = []
        for axes in dims:
            k = 0
            for a in axes:  # major to minor
                k = k * mesh.size(a) + int(coords[a])
            idx.append(k)
        holders.setdefault((idx[0], idx[1]), []).append(dev)
    plt, fig, ax = _figure(max(6.5, 2.0 + 1.3 * ncol), 1.6 + 0.8 * nrow)
    for (r, c), devs in holders.items():
        ax.add_patch(
            plt.Rectangle(
                (c, nrow - 1 - r), 0.96, 0.94, color=STAGE_COLOURS[(r * ncol + c) % 6], alpha=0.8
            )
        )
        ax.text(c + 0.48, nrow - 1 - r + 0.47, "dev " + ",".join(map(str, devs)), ha="center",
                va="center", color="white", fontsize=8, wrap=True)  # fmt: skip
    ax.set_xlim(0, ncol)
    ax.set_ylim(0, nrow)
    ax.set_xticks([])
    ax.set_yticks([])
    shape = inp.shape if len(inp.shape) >= 2 else (*inp.shape, 1)
    ax.set_xlabel(f"dim 1 ({shape[1]}) split over {'+'.join(dims[1]) or 'nothing'}")
    ax.set_ylabel(f"dim 0 ({shape[0]}) split over {'+'.join(dims[0]) or 'nothing'}")
    ax.set_title(f"{short_path(inp.path)} {spec.format(inp.shape, inp.dtype)}: who holds which block",
                 fontsize=9)  # fmt: skip
    return _png(plt, fig), inp.path


def write_pictures(d: PlanDigest, tensor: str | None = None) -> Pictures:
    """The pictures of ``d`` (module docstring): ``timeline`` only where there is a
    pipeline schedule to draw (more than one stage)."""
    tensor_png, path = tensor_picture(d, tensor)
    png = {"mesh": mesh_picture(d)}
    if d.parallelism.num_stages > 1:
        png["timeline"] = timeline_picture(d)
    png.update(memory=memory_picture(d), tensor=tensor_png)
    return Pictures(png, path)
