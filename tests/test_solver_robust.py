"""Issue #14, finding 6: a time limit never leaves the user without a plan, bad limits are
refused on the command line, and the solver's process and files never outlive a solve."""

import json
import subprocess
import sys

import pytest


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "autoshard", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("solver", ["cbc", "highs"])
def test_cli_time_limit_too_short_still_prints_a_plan_and_warns(solver):
    proc = _cli(
        *f"plan --model gpt-tiny --mesh 2x4 --solver {solver} --time-limit 0.01 --json".split()
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "autoshard: warning:" in proc.stderr and "--time-limit" in proc.stderr
    out = json.loads(proc.stdout)  # exactly one JSON document
    assert out["solver"]["status"] == "time_limit"
    assert out["specs"] and out["objective"] > 0
    if out["solver"]["fallback"] is not None:  # no incumbent: the cheapest fallback, said so
        assert out["solver"]["fallback"] in ("greedy", "dp", "zero2", "zero3", "megatron")
        assert any("cheapest feasible fallback" in n for n in out["notes"])


def test_cli_time_limit_fallback_is_the_cheapest_of_the_candidates():
    proc = _cli(*"plan --model gpt-tiny --mesh 2x4 --time-limit 0.01 --json".split())
    out = json.loads(proc.stdout)
    assert out["solver"]["fallback"] is not None
    (note,) = [n for n in out["notes"] if "fallback" in n]
    costs = [float(part.split()[-1]) for part in note.split(" of: ")[1].split(";")[0].split(", ")]
    assert len(costs) >= 2
    assert out["objective"] == pytest.approx(min(costs), rel=1e-5)


@pytest.mark.parametrize("limit", ["0", "-5", "nan", "inf"])
def test_cli_refuses_a_time_limit_that_is_not_a_positive_number(limit):
    proc = _cli("plan", "--model", "gpt-tiny", "--mesh", "2x4", f"--time-limit={limit}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    # refused by the flag's type (a positive number) or, for inf, by IntraOptions
    said = "time_limit_s=" in proc.stderr or (
        "--time-limit" in proc.stderr and "positive number" in proc.stderr
    )
    assert said and "Traceback" not in proc.stderr, proc.stderr


def test_cli_no_plan_in_time_under_a_budget_is_an_error_not_a_traceback():
    argv = "plan --model gpt-tiny --mesh 2x4 --memory-budget 0.00001 --time-limit 0.01"
    proc = _cli(*argv.split())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "autoshard: error:" in proc.stderr and "--time-limit" in proc.stderr
