"""A stage-ILP worker process (:mod:`autoshard.inter.unit_pool` starts it with
``python -c``): jobs in on stdin, each a layer and logical mesh of a pickled
:class:`~autoshard.inter.stage_cost.IntraStageCost` copy, units out on stdout. Apart from
the pool so that the pool does not import the stage cost it is fed by (no import circle).
"""

from __future__ import annotations

import os
import pickle
import sys


def worker_main() -> None:
    """A worker's loop: jobs in on stdin until it closes, results out on the original
    stdout (what the worker itself prints goes to stderr)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's: it stops us
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import ml_dtypes  # noqa: F401  (numpy's names of jax's dtypes: np.dtype("bfloat16"))

    import autoshard.inter.stage_cost  # noqa: F401
    import autoshard.intra.ilp.solvers  # noqa: F401

    try:
        import highspy  # noqa: F401
    except ImportError:  # the solver's own error comes with the first ILP
        pass
    states: dict = {}  # token -> (cost copy, sub-graph per layer, mesh per logical mesh)
    while True:
        try:
            token, blob, i, logical, handoffs = pickle.load(sys.stdin.buffer)
        except EOFError:
            return
        try:
            if blob is not None:
                states.clear()  # one search at a time
                states[token] = pickle.loads(blob)
            result = ("ok", pool_unit(states[token], i, logical, handoffs))
        except Exception as err:  # noqa: BLE001 -- sent back and raised by the caller
            import traceback

            result = ("error", f"{type(err).__name__}: {err}", traceback.format_exc())
        pickle.dump(result, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()


def pool_unit(state, i: int, logical, handoffs=None):
    """In a worker: the unit of layer ``i`` on ``logical`` and what solving it counted
    (ILPs, ILP seconds, cache hits, refusals, disk-cache hits). ``handoffs``: what it
    reads from units planned before it, as the caller read them (None: nothing)."""
    cost, subgraphs, meshes = state
    before = (cost.num_ilps, cost.ilp_seconds, cost.num_cache_hits, len(cost.refusals))
    disk_hits = cost.num_disk_hits
    unit = cost._plan_unit(subgraphs[i], meshes[logical], handoffs or ((), ()))
    counts = (
        cost.num_ilps - before[0],
        cost.ilp_seconds - before[1],
        cost.num_cache_hits - before[2],
        tuple(cost.refusals[before[3] :]),
        cost.num_disk_hits - disk_hits,
    )
    return i, logical, unit, counts
