"""autoshard: Alpa-style automatic parallelization for JAX, with plans checked against XLA.

The planner modules (graph, cost, strategies, ilp, stages, plan) do not import jax;
the public names below load lazily so that importing them does not either.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "inspect_model": "autoshard.api",
    "auto_shard": "autoshard.api",
    "IntraOptions": "autoshard.intra.problem.options",
    "plan_workload": "autoshard.api",
    "auto_pipeline": "autoshard.api_pipeline",
    "ParallelPlan": "autoshard.ir.plan",
    "load_plan": "autoshard.ir.planfile",
    "PlanFile": "autoshard.ir.planfile",
    "bind_plan": "autoshard.api",
    "trace_workload": "autoshard.api",
    "get_workload": "autoshard.models",
    "make_optimizer": "autoshard.models",
    "make_train_step": "autoshard.models",
    "TraceError": "autoshard.trace.jaxpr",
    "trace": "autoshard.trace.jaxpr",
    "trace_train_step": "autoshard.trace.jaxpr",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'autoshard' has no attribute {name!r}")
