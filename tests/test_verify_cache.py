"""``verify`` under JAX's persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``).

jax leaves the ``xla_dump_*`` options out of its cache key, so the second, dumped compile
that reads XLA's live peak (``measure_live_peak``) would load the first compile's entry and
XLA would write no dumps: the live peak came back unknown for anyone with a cache set. The
dumped compile now goes past the cache (a key of its own, nothing written). Run in a fresh
process: the cache is chosen once per process, before the first compile.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    import autoshard
    from autoshard.intra.problem.options import IntraOptions

    cache = jax.config.jax_compilation_cache_dir
    bound = autoshard.plan_workload(
        "mlp", "2x4", options=IntraOptions(solver="highs"), batch_size=16, hidden=16
    )
    out = []
    for _ in range(2):
        report = bound.verify(devices=jax.devices()[:8], live_peak="always")
        out.append(
            dict(
                live=report.compiled_live_peak_bytes,
                note=report.live_peak_note,
                entries=len(os.listdir(cache)),
            )
        )
    print(json.dumps(out))
    """
)


def test_the_live_peak_is_read_with_a_persistent_cache_and_fills_no_entries(tmp_path):
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = json.loads(proc.stdout.strip().splitlines()[-1])
    # both verifies read XLA's dumps: the second one's step loaded from the cache, its
    # dumped compile did not
    assert first["live"] is not None and first["live"] > 0, first["note"]
    assert second["live"] == first["live"], second["note"]
    assert first["entries"] >= 1  # the cache is in use: the plain compile was written
    assert second["entries"] == first["entries"]  # the dumped compiles wrote nothing


# ----------------------------------------------------------------------------- loaded
# What verify reads from an executable jax loads from its persistent cache (the demo's run
# step; anyone's JAX_COMPILATION_CACHE_DIR) is what the compile it stands in for reports:
# the compiled HLO less its metadata (jax leaves op names and source lines out of its key,
# so a hit carries the first compile's), memory_analysis and cost_analysis.
_CACHE_SETTINGS = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


@contextlib.contextmanager
def _persistent_cache_in(folder: str):
    """Every compile inside goes to a persistent cache in ``folder`` (however quick or
    small); this process's settings before are restored after."""
    import jax
    from jax._src import compilation_cache

    before = [getattr(jax.config, name) for name in _CACHE_SETTINGS]
    for name, value in zip(_CACHE_SETTINGS, (folder, 0, -1)):
        jax.config.update(name, value)
    compilation_cache.reset_cache()  # jax decides whether to use a cache once, then keeps it
    try:
        yield
    finally:
        for name, value in zip(_CACHE_SETTINGS, before):
            jax.config.update(name, value)
        compilation_cache.reset_cache()


def _compile_a_sharded_step():
    """A step with collectives on 8 devices, a new function each call: jax's in-memory
    caches miss, so only the persistent cache can stand in for XLA."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    def step(w, x):
        def loss(w):
            return jnp.sum(jnp.tanh(x @ w) ** 2)

        return w - 0.1 * jax.grad(loss)(w)

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    w = jax.ShapeDtypeStruct(
        (128, 256), jnp.float32, sharding=NamedSharding(mesh, P(None, "model"))
    )
    x = jax.ShapeDtypeStruct((32, 128), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    return jax.jit(step).lower(w, x).compile()


def _without_metadata(text: str) -> str:
    """The compiled module's text less what jax leaves out of its cache key: op names and
    source lines, and the tables of files and stack frames they point into."""
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    return re.sub(
        r"\n\n(FileNames|FunctionNames|FileLocations|StackFrames)\n.*?(?=\n\n)",
        "",
        text,
        flags=re.S,
    )


def _cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {k: cost[k] for k in ("flops", "bytes accessed")}


def test_an_executable_loaded_from_the_cache_reads_as_the_compiled_one(tmp_path):
    from jax._src import monitoring

    from autoshard.verify.check import compiled_hlo_text
    from autoshard.verify.memory import memory_stats

    hits = []

    def count(name, **_):
        if name == "/jax/compilation_cache/cache_hits":
            hits.append(name)

    monitoring.register_event_listener(count)
    try:
        with _persistent_cache_in(str(tmp_path)):
            compiled = _compile_a_sharded_step()  # an empty folder: compiled, and written
            assert not hits and os.listdir(tmp_path)
            loaded = _compile_a_sharded_step()
            assert len(hits) == 1  # the same module: loaded, not compiled
    finally:
        monitoring.unregister_event_listener(count)
    text = compiled_hlo_text(compiled)
    assert "all-reduce" in text or "reduce-scatter" in text  # a step with collectives
    assert _without_metadata(compiled_hlo_text(loaded)) == _without_metadata(text)
    assert memory_stats(loaded) == memory_stats(compiled)
    assert _cost(loaded) == _cost(compiled) and _cost(compiled)["flops"] > 0
