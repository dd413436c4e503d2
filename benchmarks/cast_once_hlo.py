"""Parameter casts per micro-batch in the pipeline's compiled stage programs, with the
weights cast once a step (``cast_once``, the default) and without.

gpt-tiny in bf16 (f32 weights read through a convert to bf16), two equal-layer stages on 4
fake CPU devices each, 4 micro-batches (``auto_pipeline``). Per stage: the traced
equations that convert a parameter (what the per-micro-batch program runs without
``cast_once``), the parameters the micro-batches read in bf16, and in the compiled
forward and backward of one micro-batch the converts whose operand and result have a
parameter's per-device shape (f32 -> bf16: a weight's cast; bf16 -> f32: a weight
gradient's). Prints one line per stage and program.

    python benchmarks/cast_once_hlo.py
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from autoshard.api_pipeline import auto_pipeline  # noqa: E402
from autoshard.models import get_workload, make_optimizer  # noqa: E402

_VALUE = re.compile(r"%([\w.\-]+) = (\w+)\[([^\]]*)\]")
_CONVERT = re.compile(r"= (\w+)\[([^\]]*)\][^ ]* convert\(%([\w.\-]+)\)")


def param_casts(text: str, shapes: set[str]) -> tuple[int, int]:
    """(f32 -> bf16, bf16 -> f32) converts in HLO ``text`` of a per-device shape in
    ``shapes`` (comma-joined dims)."""
    dtype = {m.group(1): m.group(2) for m in _VALUE.finditer(text)}
    down = up = 0
    for out, shape, src in _CONVERT.findall(text):
        if shape not in shapes:
            continue
        down += out == "bf16" and dtype.get(src) == "f32"
        up += out == "f32" and dtype.get(src) == "bf16"
    return down, up


def main() -> None:
    workload = get_workload("gpt-tiny", dtype="bfloat16")
    opt = make_optimizer("adamw")
    params, _, batch = workload.init_train_args(opt, seed=0)
    for cast_once in (False, True):
        trainer = auto_pipeline(
            workload.loss_fn, opt, params, batch, devices=jax.devices(), num_microbatches=4,
            stages="equal-layer", num_stages=2, cluster="dgx-a100", cast_once=cast_once,
        )  # fmt: skip
        for i, st in enumerate(trainer.stage_executables):
            leaves = jax.tree.leaves(st.params)
            shapes = {
                ",".join(map(str, sh.shard_shape(tuple(p.shape))))
                for p, sh in zip(leaves, jax.tree.leaves(st.param_shardings), strict=True)
            }
            live = jax.tree.leaves(st.live_params())
            read16 = sum(x.dtype == jax.numpy.bfloat16 for x in live)
            print(
                f"cast_once={cast_once} stage {i}: {len(leaves)} parameters, "
                f"{len(st.cast_once)} cast once a step, {read16} read in bf16"
            )
            programs = (
                ("forward", trainer.compiled_forward(i)),
                ("backward", trainer.compiled_backward(i)),
            )
            for name, compiled in programs:
                down, up = param_casts(compiled.as_text(), shapes)
                print(f"  {name}: parameter-shaped converts f32->bf16 {down}, bf16->f32 {up}")


if __name__ == "__main__":
    main()
