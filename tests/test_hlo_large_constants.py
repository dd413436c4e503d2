"""On 64 devices the table of each device's slice offset is a literal that ``as_text()``
elides (``constant({...})``), so an all-reduce + dynamic-slice could not be read as the
reduce-scatter it is; ``compiled_hlo_text`` writes it out (the verifier's text)."""

import subprocess
import sys

CODE = r"""
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_num_cpu_devices", 64)
from jax.sharding import NamedSharding, PartitionSpec as P
from autoshard.ir.spec import Mesh
from autoshard.verify.check import compiled_hlo_text
from autoshard.verify.collectives import analyze_collectives
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(8, 8), ("data", "model"))
def f(x):
    x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, "model")))
    s = x.sum(-1)  # partial over model, read split over model: all-reduce + dynamic-slice
    return jax.lax.with_sharding_constraint(s * 2.0, NamedSharding(mesh, P("model")))
c = jax.jit(f).lower(jax.ShapeDtypeStruct((64, 64), jnp.float32)).compile()
logical = Mesh(("data", "model"), (8, 8))
for text in (c.as_text(), compiled_hlo_text(c)):
    found = analyze_collectives(text, logical, range(64)).collectives
    print("{...}" in text, sorted((x.collective.kind, x.collective.axes) for x in found))
"""


def test_the_offset_table_is_written_out_on_64_devices():
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    elided, full = proc.stdout.strip().splitlines()
    assert elided.startswith("True") and "('all-reduce', ('model',))" in elided
    assert full == "False [('reduce-scatter', ('model',))]"
