"""Argument types and groups shared by the ``autoshard`` subcommands."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_model_args(
    p: argparse.ArgumentParser, optimizer: bool = True, model_required: bool = True
) -> None:
    """``--model`` and the size overrides (and ``--optimizer``)."""
    p.add_argument(
        "--model", required=model_required, help="preset name, e.g. gpt-tiny, gpt-1.3b, mlp"
    )
    p.add_argument("--batch", type=positive_int, help="global batch size")
    p.add_argument("--seq", type=positive_int, help="sequence length")
    p.add_argument("--vocab", type=positive_int, help="vocabulary size")
    p.add_argument("--layers", type=positive_int, help="number of layers (transformer blocks)")
    p.add_argument("--hidden", type=positive_int, help="hidden size")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="compute dtype")
    if optimizer:
        p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")


def model_overrides(args) -> dict:
    """The size overrides as ``get_workload`` keywords."""
    return dict(
        batch_size=args.batch,
        seq_len=args.seq,
        vocab_size=args.vocab,
        num_layers=args.layers,
        hidden=args.hidden,
        dtype=args.dtype,
    )


def gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def add_intra_option_args(p: argparse.ArgumentParser) -> None:
    """Alpa's ``AutoShardingOption`` knobs, as fields of
    :class:`~autoshard.intra.options.IntraOptions` (solver, time limit, budget and
    merging have their own flags on each command)."""
    p.add_argument(
        "--force-batch-axis",
        metavar="AXIS",
        help="split every data input's batch dimension over this mesh axis (e.g. data)",
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
        "--no-mixed-mesh-shape",
        action="store_true",
        help="split each tensor dimension over at most one mesh axis "
        "(Alpa's allow_mixed_mesh_shape=False)",
    )


def intra_options(args):
    """The :class:`~autoshard.intra.options.IntraOptions` the flags in ``args`` ask for
    (ValueError, with the flag's meaning, for a value it refuses)."""
    from autoshard.intra.options import IntraOptions

    budget = getattr(args, "memory_budget", None)
    return IntraOptions(
        solver=args.solver,
        time_limit_s=args.time_limit,
        merge_elementwise=getattr(args, "merge_elementwise", False),
        memory_budget_bytes=None if budget is None else budget * 2**30,
        force_batch_dim_to_mesh_axis=getattr(args, "force_batch_axis", None),
        allow_mixed_mesh_shape=not getattr(args, "no_mixed_mesh_shape", False),
        layer_period=getattr(args, "layer_period", 2),
    )
