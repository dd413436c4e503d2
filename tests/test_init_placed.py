"""init_placed: a step's training state made in the plan's shardings and memory kinds,
equal to ``Workload.init_train_args`` (autoshard/runtime/init_state.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from autoshard.api import plan_workload
from autoshard.intra.problem.options import IntraOptions
from autoshard.models import get_workload, make_optimizer
from autoshard.runtime.init_state import init_placed
from autoshard.runtime.sharded import run_steps

HIGHS = IntraOptions(solver="highs", time_limit_s=60.0)


@pytest.fixture(scope="module", params=["optimizer", "optimizer,master"])
def offloaded(request):
    kw = dict(options=HIGHS, cluster="alpa-v100", optimizer="adamw", num_layers=1, dtype="bfloat16")
    return plan_workload("gpt-tiny", "2", offload=request.param, **kw)


@pytest.mark.parametrize("chunk_bytes", [1 << 40, 1 << 12])
def test_placed_state_equals_the_eager_one_where_the_plan_keeps_it(offloaded, chunk_bytes):
    workload = get_workload("gpt-tiny", num_layers=1, dtype="bfloat16")
    opt = make_optimizer("adamw")
    step = offloaded.jit(jax.devices()[:2])
    placed = init_placed(step, workload, opt, seed=3, chunk_bytes=chunk_bytes)
    eager = workload.init_train_args(opt, seed=3)
    got, want = jax.tree_util.tree_leaves(placed), jax.tree_util.tree_leaves(eager)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        # the same keys and functions; jit may fuse an initialiser's arithmetic (1 ulp)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)
    host = set(offloaded.plan.offload["host_inputs"])
    assert host
    wanted = jax.tree_util.tree_leaves(step.in_shardings)
    for i, leaf in enumerate(got):
        assert leaf.sharding.memory_kind == ("pinned_host" if i in host else "device"), i
        assert leaf.sharding.is_equivalent_to(wanted[i], leaf.ndim), i


def test_placed_state_trains_as_the_copied_one(offloaded):
    workload = get_workload("gpt-tiny", num_layers=1, dtype="bfloat16")
    opt = make_optimizer("adamw")
    step = offloaded.jit(jax.devices()[:2])
    placed = init_placed(step, workload, opt)
    _, want = run_steps(step, placed, 2)  # copies: placed survives
    _, got = run_steps(step, placed, 2, copy=False)  # consumes placed, copies nothing
    assert got == want
    assert np.isfinite(got).all() and got[1] < got[0]


def test_a_step_of_another_workload_is_refused(offloaded):
    step = offloaded.jit(jax.devices()[:2])
    other = get_workload("gpt-tiny", num_layers=2)
    with pytest.raises(ValueError, match="init_placed"):
        init_placed(step, other, make_optimizer("adamw"))
