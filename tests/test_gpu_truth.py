"""benchmarks/gpu_truth.py's pipeline on fake CPU devices (``--dry-run``), as a GPU runs it.

Plans gpt-tiny the way ``--make-plans`` plans gpt-1.3b (plan files + manifest), then runs
the script's compile-and-compare on 8 fake CPU devices: one JSON with a row per plan,
predicted next to compiled, the compiled HLO in a tar; a plan made for another program
and a plan refused when planned come out as rows that say so, not as a crash.
"""

import gzip
import json
import math
import subprocess
import sys
import tarfile

import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def gpu_truth():
    return load_benchmark("gpu_truth")


@pytest.fixture(scope="module")
def plans(gpu_truth, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu_truth_plans")
    row = gpu_truth.Row("gpt-tiny", 1, "auto", "2x4")
    manifest = gpu_truth.make_plans([row], folder, time_limit=60)
    (entry,) = manifest["rows"]
    assert entry["file"].endswith(".json.gz") and (folder / entry["file"]).exists()
    # a plan made for another program (as a plan file from jax 0.10 is on jax 0.11)
    doc = json.loads(gzip.open(folder / entry["file"]).read())
    doc["fingerprint"]["program"]["sha256"] = "0" * 64
    doc["fingerprint"]["program"]["nodes"] += 1
    (folder / "other.json").write_text(json.dumps(doc))
    refused = {"name": "gpt-tiny-L2-megatron-8", "model": "gpt-tiny", "layers": 2}
    refused.update(plan="megatron", mesh="8", refused="heads do not divide")
    manifest["rows"] += [
        {**entry, "name": "other-program", "file": "other.json"},
        refused,
    ]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_dry_run_writes_predicted_vs_compiled_per_row(gpu_truth, plans, tmp_path):
    out, tar = tmp_path / "truth.json", tmp_path / "hlo.tar.gz"
    argv = ["--dry-run", "--plans", str(plans), "--out", str(out), "--hlo-tar", str(tar)]
    assert gpu_truth.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["target"] == "cpu" and doc["backend"] == "cpu"
    by_name = {r["name"]: r for r in doc["rows"]}
    assert list(by_name) == ["gpt-tiny-L1-auto-2x4", "other-program", "gpt-tiny-L2-megatron-8"]

    row = by_name["gpt-tiny-L1-auto-2x4"]
    assert row["status"] == "compiled" and row["target"] == "cpu"
    assert row["devices"].startswith("8 x ")
    from autoshard.ir.planfile import load_plan

    plan = load_plan(plans / "gpt-tiny-L1-auto-2x4.json.gz").plan
    assert sum(r["predicted_bytes"] for r in row["collectives"]) == sum(
        c.bytes for c in plan.predicted_collectives
    )
    assert row["predicted_peak_bytes"] == plan.predicted_peak_bytes
    assert row["compiled_peak_bytes"] > 0 and row["compile_seconds"] > 0
    assert any(r["compiled_count"] for r in row["collectives"])  # it read the compiled HLO
    assert row["memory_error_signed"] == pytest.approx(
        (row["predicted_peak_bytes"] - row["compiled_peak_bytes"]) / row["compiled_peak_bytes"]
    )
    assert row["xla_warnings"]["involuntary_full_rematerializations"] >= 0
    assert all("operand 0 of" not in note for note in row["verification"]["notes"])

    other = by_name["other-program"]
    assert other["status"] == "not compiled" and "program differs" in other["reason"]
    refused = by_name["gpt-tiny-L2-megatron-8"]
    assert (
        refused["status"] == "refused when planned" and refused["reason"] == "heads do not divide"
    )

    with tarfile.open(tar) as t:
        assert t.getnames() == ["gpt-tiny-L1-auto-2x4.hlo.txt"]
        text = t.extractfile("gpt-tiny-L1-auto-2x4.hlo.txt").read()
        assert b"HloModule" in text and b"all-" in text
        assert b"metadata={" not in text  # the bulk of the text, none of what is read

    # read again from the stored HLO; the plan made for another program is left out, said so
    other_hlo = tmp_path / "other-program.hlo.txt.gz"
    other_hlo.write_bytes(gzip.compress(text))
    again = tmp_path / "reread.json"
    argv = ["--reread", str(out), str(tar), str(other_hlo), "--plans", str(plans)]
    assert gpu_truth.main([*argv, "--out", str(again)]) == 0
    reread = {r["name"]: r for r in json.loads(again.read_text())["rows"]}
    assert list(reread) == ["gpt-tiny-L1-auto-2x4", "other-program"]
    assert [r["kind"] for r in reread["gpt-tiny-L1-auto-2x4"]["collectives"]] == [
        r["kind"] for r in row["collectives"]
    ]
    assert "program differs" in reread["other-program"]["not_bound"]


def test_a_gpu_target_without_cuda_is_refused_before_any_row(gpu_truth, plans, tmp_path, capsys):
    out = tmp_path / "truth.json"
    assert gpu_truth.main(["--plans", str(plans), "--out", str(out), "--target", "gpu-aot"]) == 2
    assert "needs a CUDA jaxlib" in capsys.readouterr().err and not out.exists()


def test_notes_of_combined_operands_are_condensed(gpu_truth):
    notes = [
        "operand 0 of 3 of a combined all-reduce",
        "operand 1 of 3 of a combined all-reduce; bf16 upcast to f32 normalised",
        "operand 2 of 3 of a combined all-reduce; bf16 upcast to f32 normalised",
        "inside while loop %w: counted once, runs 4 times",
        "part 0 of 2 of an all-reduce combined by concatenation",
        "part 1 of 2 of an all-reduce combined by concatenation; all-reduce + dynamic-slice "
        "normalised to reduce-scatter (offsets checked on all 8 devices)",
    ]
    assert gpu_truth._condensed(notes) == {
        "an operand of a combined collective": 2,
        "all-reduce + dynamic-slice normalised to reduce-scatter (offsets checked on all 8 "
        "devices)": 1,
        "bf16 upcast to f32 normalised": 2,
        "inside while loop %w: counted once, runs 4 times": 1,
    }


def test_xla_remat_warnings_are_counted(gpu_truth):
    line = (
        "W1127 spmd_partitioner.cc:652] [spmd] Involuntary full rematerialization. The compiler "
        "cannot go from sharding {devices=[8,1]<=[8]} to {devices=[1,8]<=[8]} efficiently"
    )
    found = gpu_truth._xla_warnings(f"other\n{line}\n{line}\n")
    assert found["involuntary_full_rematerializations"] == 2
    assert found["examples"][0].startswith("W1127")


def test_autoshard_imports_where_the_solver_is_not_installed():
    # the lent GPU machine has jax with CUDA but neither PuLP nor highspy: binding and
    # verifying saved plans must not need them, and planning says what is missing
    code = (
        "import sys\n"
        "sys.modules['pulp'] = None\n"
        "sys.modules['highspy'] = None\n"
        "import autoshard.api, autoshard.cli.main, autoshard.verify.check\n"
        "from autoshard.intra.ilp.solvers import _check_solver\n"
        "from autoshard.intra.ilp.problem import SolverUnavailableError\n"
        "try:\n"
        "    _check_solver('highs')\n"
        "except SolverUnavailableError as err:\n"
        "    print(err)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "PuLP is not installed" in proc.stdout and "still verify" in proc.stdout


def test_suites_have_unique_rows_estimates_and_their_own_plan_folders(gpu_truth):
    assert set(gpu_truth.SUITES) == set(gpu_truth.SUITE_PLANS)
    assert len(set(gpu_truth.SUITE_PLANS.values())) == len(gpu_truth.SUITES)
    for rows in gpu_truth.SUITES.values():
        names = [r.name for r in rows]
        assert len(names) == len(set(names))
        assert all(gpu_truth.ESTIMATED_S[n] > 0 for n in names)
    scale = gpu_truth.SUITES["scale"]
    gpus = {math.prod(int(s) for s in r.mesh.split("x")) for r in scale}
    assert {8, 16, 64, 512} <= gpus
    assert {r.model for r in scale} >= {"gpt-1.3b", "gpt-6.7b", "gpt-39b", "moe-1.3b"}
    assert gpu_truth.Row("gpt-39b", 48, "auto", "64x8", batch=64).name.endswith("-B64")
    assert gpu_truth.Row("gpt-tiny", 2, "auto", "2x4").overrides == {
        "num_layers": 2,
        "batch_size": None,
    }


def test_a_suite_without_plans_says_how_to_make_them(gpu_truth, tmp_path, capsys):
    argv = ["--suite", "scale", "--plans", str(tmp_path), "--dry-run"]
    assert gpu_truth.main([*argv, "--out", str(tmp_path / "t.json")]) == 2
    assert "--make-plans --suite scale" in capsys.readouterr().err
    assert gpu_truth.main(["--list", "--suite", "scale", "--plans", str(tmp_path)]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 1 + len(gpu_truth.SUITES["scale"])
    assert all("not made" in line for line in listed[1:])


def test_the_budget_skips_a_row_its_estimate_would_overrun(gpu_truth, plans, tmp_path):
    out = tmp_path / "truth.json"
    name = "gpt-tiny-L1-auto-2x4"
    gpu_truth.ESTIMATED_S[name] = 1e6  # far past the budget: skipped before compiling
    try:
        argv = ["--dry-run", "--plans", str(plans), "--out", str(out), "--budget-s", "100"]
        assert gpu_truth.main([*argv, "--rows", name, "gpt-tiny-L2-megatron-8"]) == 1
    finally:
        del gpu_truth.ESTIMATED_S[name]
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows[name]["status"] == "skipped" and "budget" in rows[name]["reason"]
    assert rows["gpt-tiny-L2-megatron-8"]["status"] == "refused when planned"  # costs nothing


def test_a_plan_re_made_after_a_run_is_not_read_against_its_hlo(gpu_truth):
    """A run's stored HLO was compiled from the plan file of its day: a plan file the
    manifest says was made later (the suite's rows re-made once the program changed) is
    not compared with it, with a reason; one made before, or with no date, is."""
    made = {"made": "2026-11-28 01:54 UTC"}
    assert "re-made (2026-11-28 01:54 UTC)" in gpu_truth._remade_since(
        made, "2026-11-27 22:21 UTC and 2026-11-27 22:24 UTC"
    )
    assert gpu_truth._remade_since(made, "2026-11-28 02:10-02:20 UTC") == ""
    assert gpu_truth._remade_since({}, "2026-11-27 06:58-07:05 UTC") == ""
    assert gpu_truth._remade_since(made, None) == ""
