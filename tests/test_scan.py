"""Scans over layers: ``nn.scan`` GPT is traced unrolled, planned like its unrolled twin,
and trains like one device."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard.intra.problem.options import IntraOptions
from autoshard.models import get_workload, make_optimizer, make_train_step
from autoshard.runtime.reference_check import check_against_single_device
from autoshard.trace import flatten
from autoshard.trace.jaxpr import trace, trace_train_step


@functools.cache
def _traced(scan: bool, layers: int = 3):
    opt = make_optimizer("sgd")
    w = get_workload("gpt-tiny", num_layers=layers, scan_layers=scan)
    step = make_train_step(w.loss_fn, opt)
    return w, opt, step, trace_train_step(step, *w.abstract_train_args(opt))


def test_scanned_gpt_is_traced_as_its_unrolled_layers():
    _, _, _, scanned = _traced(True)
    _, _, _, unrolled = _traced(False)
    rec = scanned.records
    assert rec.layers == unrolled.records.layers == (
        "embedding", "block_0", "block_1", "block_2", "head",
    )  # fmt: skip
    assert not any(e.primitive == "scan" for e in rec.eqns)
    # every iteration runs the same program, forward and backward
    for phase in ("forward", "backward"):
        counts = {
            layer: sum(1 for e in rec.eqns if e.layer == layer and e.phase == phase)
            for layer in ("block_0", "block_1", "block_2")
        }
        assert len(set(counts.values())) == 1, (phase, counts)
    # the stacked parameters are one input each, [L, ...]
    kernel = next(t for t in rec.tensors if t.path.endswith("['qkv']['kernel']"))
    assert kernel.kind == "param" and kernel.shape == (3, 64, 192)


def test_unrolled_program_computes_the_scanned_step():
    w, opt, step, program = _traced(True)
    args = w.init_train_args(opt)
    want = jax.jit(step)(*args)
    got = jax.jit(program.evaluate)(*args)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)


def test_static_fori_loop_is_unrolled_and_long_scans_stay_whole(monkeypatch):
    def f(x):
        return jax.lax.fori_loop(0, 4, lambda i, c: jnp.tanh(c) * 2.0, x)

    x = jax.ShapeDtypeStruct((8, 4), jnp.float32)
    prims = [e.primitive for e in trace(f, x).records.eqns]
    assert "scan" not in prims and "while" not in prims and prims.count("tanh") == 4
    monkeypatch.setattr(flatten, "MAX_UNROLLED_EQNS", 3)  # 4 iterations x 3 eqns > 3
    prims = [e.primitive for e in trace(f, x).records.eqns]
    assert prims.count("scan") == 1 and "tanh" not in prims


@pytest.mark.heavy  # out of the default run; CI's heavy step runs it (.ci/run)
@pytest.mark.parametrize("mesh", [(2, 4)])
def test_scanned_and_unrolled_gpt_get_plans_of_equal_cost_and_train_like_one_device(mesh):
    options = IntraOptions(solver="highs")
    objectives = {}
    for scan in (False, True):
        bound = autoshard.plan_workload(
            "gpt-tiny", mesh, optimizer="sgd", options=options, num_layers=2, scan_layers=scan
        )
        objectives[scan] = bound.plan.objective
        w = get_workload("gpt-tiny", num_layers=2, scan_layers=scan)
        report = check_against_single_device(
            bound.program,
            bound.plan,
            bound.mesh(),
            w.init_train_args(make_optimizer("sgd")),
            num_steps=2,
            rtol=1e-5,
        )
        assert report.ok, report
    assert objectives[True] == pytest.approx(objectives[False], rel=1e-3), objectives
