"""Argument types and groups shared by the ``autoshard`` subcommands."""

from __future__ import annotations

import argparse

# the model presets, kept here so that building the parser imports no jax (the models do);
# tests/test_report_cli.py checks it against autoshard.models.model_names()
MODEL_PRESETS = (
    "gpt-tiny", "gpt-125m", "gpt-350m", "gpt-760m", "gpt-1.3b", "gpt-2.6b", "gpt-6.7b",
    "gpt-15b", "gpt-39b", "gpt-76b",
    "moe-tiny", "moe-380m", "moe-690m", "moe-1.3b", "moe-2.4b", "moe-10b", "moe-27b", "moe-70b",
    "mlp",
    "wresnet-tiny", "wresnet-small", "wresnet-250m", "wresnet-500m", "wresnet-1b", "wresnet-2b",
    "wresnet-4b", "wresnet-6.8b", "wresnet-13b",
)  # fmt: skip

# autoshard.models.OPTIMIZERS, without importing the models (tests check them equal)
OPTIMIZER_CHOICES = ("adamw", "adafactor", "sgd", "sgd-momentum")

# IntraOptions.exact_search's choices, without importing the planner (tests check them equal)
EXACT_SEARCH = ("lp", "auto", "one-axis", "always", "never")


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help when it has a default worth saying
    (not None, not False) and its help does not already name one."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and default not in (None, False, argparse.SUPPRESS)
            and "default" not in text
        ):
            text += " (default: %(default)s)"
        return text


class HelpfulParser(argparse.ArgumentParser):
    """An ArgumentParser whose ``--help`` shows every option's default."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)
        # on every command and before it; SUPPRESS: a command's parser leaves a --quiet
        # given before the command alone
        self.add_argument(
            "--quiet",
            action="store_true",
            default=argparse.SUPPRESS,
            help="no progress: no spinners (off anyway when stderr is not a terminal) and no "
            "search progress lines on stderr",
        )


def check_writable(path: str, flag: str, directory: bool = False) -> None:
    """Refuse (ValueError) an output path this process cannot write, before any work: the
    nearest existing folder above it must take a new file (probed with a temporary file,
    removed again); an existing ``path`` must be a folder for ``directory`` outputs and a
    file otherwise.  Creates nothing."""
    import os
    import tempfile

    full = os.path.abspath(path)
    if os.path.exists(full) and os.path.isdir(full) != directory:
        kind = "a file" if directory else "a folder"
        raise ValueError(f"{flag} {path}: {full} is {kind}; give {flag} a "
                         f"{'folder' if directory else 'file'} path")  # fmt: skip
    probe = full if directory and os.path.isdir(full) else os.path.dirname(full)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"{flag} {path}: {probe} is a file, not a folder")
    try:
        fd, name = tempfile.mkstemp(prefix=".autoshard-probe-", dir=probe)
    except OSError as err:
        raise ValueError(
            f"{flag} {path}: cannot write in {probe} ({err.strerror or err}); give a path "
            "you can write"
        ) from None
    os.close(fd)
    os.unlink(name)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    if value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"expected a positive number, got {text}: give a finite one (leave the flag out "
            "for its default, or give a large number such as 1e6)"
        )
    return value


def add_model_args(
    p: argparse.ArgumentParser, optimizer: bool = True, model_required: bool = True
) -> None:
    """``--model`` and the size overrides (and ``--optimizer``)."""
    p.add_argument(
        "--model", required=model_required, help="model preset: " + ", ".join(MODEL_PRESETS)
    )
    p.add_argument("--batch", type=positive_int, help="global batch size (default: the preset's)")
    p.add_argument("--seq", type=positive_int, help="sequence length (default: the preset's)")
    p.add_argument("--vocab", type=positive_int, help="vocabulary size (default: the preset's)")
    p.add_argument("--layers", type=positive_int, help="transformer blocks (default: the preset's)")
    p.add_argument("--hidden", type=positive_int, help="hidden size (default: the preset's)")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16"), help="compute dtype (default: the preset's)"
    )
    p.add_argument(
        "--attention",
        choices=("fused", "unfused"),
        help="GPT / GPT-MoE program: fused (the default: one attention operator, cuDNN flash "
        "attention on GPUs; GELU and cross-entropy saving their inputs: docs/fused.md) or "
        "unfused (einsums and a softmax that keep the S x S probabilities)",
    )
    p.add_argument(
        "--scan-layers",
        action="store_true",
        help="write the GPT's blocks as one nn.scan over stacked parameters (same plan)",
    )
    if optimizer:
        p.add_argument(
            "--optimizer",
            choices=OPTIMIZER_CHOICES,
            default="adamw",
            help="optimizer of the training step (run: sgd, or the --plan file's)",
        )


def model_overrides(args) -> dict:
    """The size overrides as ``get_workload`` keywords."""
    return dict(
        batch_size=args.batch,
        seq_len=args.seq,
        vocab_size=args.vocab,
        num_layers=args.layers,
        hidden=args.hidden,
        dtype=args.dtype,
        scan_layers=getattr(args, "scan_layers", False) or None,
        attention=getattr(args, "attention", None),
    )


def cluster_presets() -> str:
    """The cluster presets shipped, for ``--help`` (``alpa-v100, dgx-a100, ...``)."""
    from autoshard.hardware.clusters import available_presets

    return ", ".join(available_presets())


def binary_size(nbytes: float) -> str:
    """``3.2 MiB``, ``512 KiB``, ``96 B``: the largest binary unit the size reaches."""
    from autoshard.ir.units import format_bytes

    return format_bytes(nbytes)


def gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def add_intra_option_args(p: argparse.ArgumentParser) -> None:
    """Alpa's ``AutoShardingOption`` knobs, as fields of
    :class:`~autoshard.intra.problem.options.IntraOptions` (solver, time limit, budget and
    merging have their own flags on each command)."""
    p.add_argument(
        "--force-batch-axis",
        metavar="AXIS",
        help="split the batch dimension of every data input, dot and convolution over this "
        "mesh axis alone, as Alpa's force_batch_dim_to_mesh_dim (e.g. data)",
    )
    p.add_argument(
        "--layer-period",
        type=int,
        default=2,
        metavar="P",
        help="tie identical layers P at a time (default 2: alternating plans reachable; "
        "1: every identical layer shares the first's plan)",
    )
    p.add_argument(
        "--layer-ends",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="leave the first and last layer of each run of identical layers untied and tie "
        "the layers between them P at a time (P + 2 layers planned whatever the depth)",
    )
    p.add_argument(
        "--no-mixed-mesh-shape",
        action="store_true",
        help="split each tensor dimension over at most one mesh axis "
        "(Alpa's allow_mixed_mesh_shape=False)",
    )
    p.add_argument(
        "--no-all-gather",
        action="store_true",
        help="forbid every resharding that needs an all-gather (Alpa's allow_all_gather=False)",
    )
    p.add_argument(
        "--no-all-to-all",
        action="store_true",
        help="forbid every resharding that needs an all-to-all (Alpa's allow_all_to_all=False)",
    )
    p.add_argument(
        "--prefer-reduce-scatter",
        action="store_true",
        help="re-plan with the optimizer state split over the data-parallel axes (gradients "
        "reduce-scattered, parameters all-gathered: ZeRO-2), kept where it sends no more "
        "bytes (Alpa's prefer_reduce_scatter; a second solve)",
    )
    p.add_argument(
        "--per-demand-pricing",
        action="store_true",
        help="price reshardings per distinct demand only (faster; can charge one resharding "
        "twice, so the objective may exceed the predicted cost). Default: once per value, "
        "as predicted",
    )
    p.add_argument(
        "--exact-search",
        choices=EXACT_SEARCH,
        default="lp",
        help="where the per-value program is solved from the per-demand plan, never with "
        "--memory-budget: on meshes with one axis > 1 (200 branch-and-bound nodes) and, on "
        "meshes of several axes whose per-demand program has at most 40,000 columns (120,000 "
        "where hubs price at least half the values several demands read), its LP "
        "relaxation (at most 32,000 simplex iterations; 40,000 over 40,000 columns), kept "
        "where integral (the proven "
        "optimum); a fractional one runs the integer program (200 nodes) on a program of at "
        "most 2,500 columns, else around the per-demand plan, kept where cheaper (lp, the "
        "default: up to 27%% cheaper plans on small 2-D programs, in seconds); the same "
        "with the integer program on every such 2-D program (auto: a 4-layer conv net on 4x2 "
        "spends the whole time limit); on one-axis meshes only (one-axis); on every mesh "
        "(always: slow on large programs of several axes); or never (the per-demand plan, "
        "priced per value)",
    )


def intra_options(args):
    """The :class:`~autoshard.intra.problem.options.IntraOptions` the flags in ``args`` ask for
    (ValueError, with the flag's meaning, for a value it refuses)."""
    from autoshard.intra.problem.options import IntraOptions

    budget = getattr(args, "memory_budget", None)
    ends = getattr(args, "layer_ends", None)  # None: the planner's default
    return IntraOptions(
        solver=args.solver,
        time_limit_s=args.time_limit,
        merge_elementwise=getattr(args, "merge_elementwise", False),
        memory_budget_bytes=None if budget is None else budget * 2**30,
        force_batch_dim_to_mesh_axis=getattr(args, "force_batch_axis", None),
        allow_mixed_mesh_shape=not getattr(args, "no_mixed_mesh_shape", False),
        allow_all_gather=not getattr(args, "no_all_gather", False),
        allow_all_to_all=not getattr(args, "no_all_to_all", False),
        prefer_reduce_scatter=getattr(args, "prefer_reduce_scatter", False),
        layer_period=getattr(args, "layer_period", 2),
        **({} if ends is None else {"layer_ends": ends}),
        exact_values=not getattr(args, "per_demand_pricing", False),
        exact_search=getattr(args, "exact_search", "lp"),
    )
