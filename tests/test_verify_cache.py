"""``verify`` under JAX's persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``).

jax leaves the ``xla_dump_*`` options out of its cache key, so the second, dumped compile
that reads XLA's live peak (``measure_live_peak``) would load the first compile's entry and
XLA would write no dumps: the live peak came back unknown for anyone with a cache set. The
dumped compile now goes past the cache (a key of its own, nothing written). Run in a fresh
process: the cache is chosen once per process, before the first compile.
"""

from __future__ import annotations

import json
import os
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
