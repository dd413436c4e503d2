"""Issue #14, finding 6: a time limit never leaves the user without a plan, bad limits are
refused on the command line, and the solver's process and files never outlive a solve."""

import json
import subprocess
import sys

import pytest
from conftest import cli_in_process


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "autoshard", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("solver", ["cbc", "highs"])
def test_cli_time_limit_too_short_still_prints_a_plan_and_warns(solver):
    proc = _cli(
        # 0.002 s: its safety net (5x) is 0.01 s, the limit this test had before the net
        *f"plan --model gpt-tiny --mesh 2x4 --solver {solver} --time-limit 0.002 --json".split()
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "autoshard: warning:" in proc.stderr and "--time-limit" in proc.stderr
    out = json.loads(proc.stdout)  # exactly one JSON document
    assert out["solver"]["status"] == "time_limit"
    assert out["specs"] and out["objective"] > 0
    # the clock, not the node budget, stopped it: the plan says so, and the warning
    assert out["solver"]["load_dependent"] is True
    assert "depends on the machine's load" in proc.stderr
    if out["solver"]["fallback"] is not None:  # no incumbent: the cheapest fallback, said so
        assert out["solver"]["fallback"] in ("greedy", "dp", "zero2", "zero3", "megatron")
        assert any("cheapest feasible fallback" in n for n in out["notes"])


def test_cli_time_limit_fallback_is_the_cheapest_of_the_candidates():
    # 0.002 s: the per-demand solve's safety net is 5x that (0.01 s, the limit this test
    # had before the net): no incumbent in time, at 0.05 s HiGHS found one at low load
    proc = _cli(*"plan --model gpt-tiny --mesh 2x4 --time-limit 0.002 --json".split())
    out = json.loads(proc.stdout)
    assert out["solver"]["fallback"] is not None
    (note,) = [n for n in out["notes"] if "fallback" in n]
    costs = [float(part.split()[-1]) for part in note.split(" of: ")[1].split(";")[0].split(", ")]
    assert len(costs) >= 2
    assert out["objective"] == pytest.approx(min(costs), rel=1e-5)


@pytest.mark.parametrize("limit", ["0", "-5", "nan", "inf"])
def test_cli_refuses_a_time_limit_that_is_not_a_positive_number(capsys, limit):
    rc, out, err = cli_in_process(
        capsys, "plan", "--model", "gpt-tiny", "--mesh", "2x4", f"--time-limit={limit}"
    )
    assert rc == 2, out + err
    # refused by the flag's type (a positive number) or, for inf, by IntraOptions
    said = "time_limit_s=" in err or ("--time-limit" in err and "positive number" in err)
    assert said and "Traceback" not in err, err


def test_cli_no_plan_in_time_under_a_budget_is_an_error_not_a_traceback(capsys):
    # one block, 0.0008 GiB (839 KiB): above the bound every plan's peak is over (a budget
    # below it is refused before any solve: 407 KiB), below the unbudgeted plan's peak
    # (983 KiB); the default two blocks at 0.001 GiB took 1.8x as long (memory rows)
    argv = "plan --model gpt-tiny --layers 1 --mesh 2x4 --memory-budget 0.0008 --time-limit 0.01"
    rc, out, err = cli_in_process(capsys, *argv.split())
    assert rc == 2, out + err
    assert "Traceback" not in err
    assert "autoshard: error:" in err and "--time-limit" in err


def _frustrated_problem():
    """Ten nodes, every pair joined by a random resharding matrix: the LP relaxation is not
    integral, so HiGHS branches (3 nodes to its proof here)."""
    import numpy as np

    from autoshard.intra.ilp import ShardingProblem
    from autoshard.intra.ilp.problem import EdgeCost

    rng = np.random.default_rng(0)
    n, k = 10, 3
    edges = tuple(
        EdgeCost(i, j, rng.uniform(0, 10, (k, k)).round(3).tolist())
        for i in range(n)
        for j in range(i + 1, n)
    )
    costs = tuple(tuple(rng.uniform(0, 1, k).round(3)) for _ in range(n))
    return ShardingProblem((k,) * n, costs, edges)


def test_node_limit_stops_at_the_same_plan_and_says_which_limit():
    """max_nodes, what the exact program's budget is made of (a time budget made the plan
    depend on the machine's load): reaching it keeps the best plan found, the same plan on
    every run, and the warning names the node limit, not the time limit."""
    import warnings

    from autoshard.intra.ilp import SolverTimeLimitWarning, solve

    problem = _frustrated_problem()
    free = solve(problem, solver="highs", merge=False, time_limit_s=None)
    assert free.status == "optimal" and free.nodes > 1  # it had to branch
    runs = []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs.append(solve(problem, solver="highs", merge=False, time_limit_s=None, max_nodes=1))
        (warning,) = [w for w in caught if issubclass(w.category, SolverTimeLimitWarning)]
        assert "max_nodes=1" in str(warning.message) and "time_limit" not in str(warning.message)
    assert runs[0].status == "time_limit" and runs[0].limit == "nodes"
    assert runs[0].strategy == runs[1].strategy  # where it stops does not depend on time
    assert runs[0].objective >= free.objective
    enough = solve(problem, solver="highs", merge=False, time_limit_s=None, max_nodes=10**6)
    assert enough.status == "optimal" and enough.strategy == free.strategy
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_nodes"):
            solve(problem, solver="highs", max_nodes=bad)


def test_exact_program_proves_its_optimum_whatever_the_load():
    """gpt-tiny's zero3 and megatron plans on 8 devices: the per-demand program over-charges
    them, and the exact program's root node takes about a second. Its old budget (half the
    per-demand solve's time, at least 0.5 s) stopped it mid-root on a loaded machine, with
    plans 25-29% dearer (2026-11-25); the node budget lets it prove its optimum.

    Its time cap of the per-demand solve's time, at least 5 s (at load 7-13 its root took
    longer than that and this test failed, 2026-11-27, until it raised the cap) is gone
    on one axis since 2026-11-28: the node budget alone stops it, within the time limit."""
    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.intra.baselines.tables import baseline_inputs, baseline_options
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.intra.problem.options import IntraOptions

    # 8 heads: the strict megatron baseline splits heads over the 8 devices (4 are refused)
    traced = trace_workload("gpt-tiny", optimizer="sgd", num_heads=8)
    mesh = device_mesh_for((8,), ("data",))
    for which in ("zero3", "megatron"):
        options = baseline_options(IntraOptions(solver="highs"), mesh.mesh, which)
        pinned = baseline_inputs(traced.graph, mesh.mesh, which)
        plan = auto_shard_graph(traced.graph, mesh, options, pinned_inputs=pinned, name=which)
        assert plan.solver["exact_stopped"] is None, plan.solver["exact_stopped"]
        assert plan.solver["status"] == "optimal"


def test_a_solve_far_past_its_time_limit_says_how_long_the_solver_ran():
    """HiGHS cannot interrupt its start-up heuristics on a huge program (gpt-tiny's
    per-demand program on 2x2x2: 95 s in ``highs.run()`` at --time-limit 10): the warning
    says so instead of implying the limit held; a solve within its limit adds nothing."""
    from types import SimpleNamespace

    from autoshard.intra.ilp.solve import _overrun
    from autoshard.intra.ilp.solvers import _Outcome

    program = SimpleNamespace(num_cols=1_337_001)
    late = _overrun(_Outcome("time_limit", None, wall_s=95.0), 10.0, program)
    assert "ran 95 s" in late and "1,337,001-column" in late
    assert _overrun(_Outcome("time_limit", None, wall_s=11.0), 10.0, program) == ""
    assert _overrun(_Outcome("time_limit", None, wall_s=95.0), None, program) == ""
    assert _overrun(_Outcome("time_limit", None), 10.0, program) == ""  # CBC: killed on time
