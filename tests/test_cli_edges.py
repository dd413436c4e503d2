"""The command line at its edges: Ctrl-C, unwritable outputs, exit statuses.

Subprocess tests (with timeouts) where the behaviour is the process's: its exit status
after a signal, what it leaves on stdout and stderr.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

MLP = ["--model", "mlp", "--batch", "16", "--hidden", "16"]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _as_from_a_terminal() -> None:
    """In the child: SIGINT's default disposition, as a command typed at a terminal has
    (a test run started in the background by a shell without job control inherits
    SIGINT ignored, and Python then never raises KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _interrupt_when(argv, marker: str | None, timeout=300):
    """Start ``autoshard *argv`` in its own process group, send the group SIGINT (as a
    terminal's Ctrl-C does) once ``marker`` shows on stderr (None: once the process has
    run 3 s of CPU, well past its imports, inside the command); its status and stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "autoshard", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
        preexec_fn=_as_from_a_terminal,
    )
    seen = []
    deadline = time.monotonic() + timeout
    try:
        if marker is None:
            while _cpu_seconds(proc.pid) < 3.0:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
        else:
            for line in proc.stderr:
                seen.append(line)
                if marker in line:
                    break
                assert time.monotonic() < deadline, "".join(seen)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, "".join(seen) + err


@pytest.mark.parametrize(
    "argv, marker",
    [
        (["run", *MLP, "--mesh", "2", "--steps", "100000"], None),
        (
            ["run", *MLP, "--mesh", "2", "--steps", "100000", "--processes", "2"],
            "started process 1 of 2",
        ),
    ],
    ids=["one process", "two processes"],
)
def test_ctrl_c_is_one_line_and_status_130(argv, marker):
    rc, out, err = _interrupt_when(argv, marker)
    assert rc == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.count("autoshard: interrupted (Ctrl-C)") == 1


# ------------------------------------------------------- cheap bounds before the searches


def test_a_mesh_of_a_million_devices_is_refused_before_jax_starts():
    proc = subprocess.run(
        [sys.executable, "-m", "autoshard", "plan", "--model", "gpt-tiny", "--mesh", "1000000"],
        capture_output=True,
        text=True,
        timeout=60,  # it used to run for minutes, growing past 5 GB
        env=ENV,
    )
    assert proc.returncode == 2
    assert "--mesh 1000000 asks for 1,000,000 fake CPU devices" in proc.stderr
    assert "makes at most 4,096" in proc.stderr and "autoshard simulate" in proc.stderr


def test_a_three_axis_mesh_is_warned_about_before_planning(capsys, monkeypatch):
    import autoshard.cli.plan as plan_cli
    from autoshard.cli.main import main

    def stop(*a, **k):
        raise ValueError("stopped before planning")

    monkeypatch.setattr(plan_cli, "plan_from_args", stop)
    assert main(["plan", *MLP, "--mesh", "2x2x2"]) == 2
    err = capsys.readouterr().err
    warning, stopped = err.index("mesh 2x2x2 has 3 axes"), err.index("stopped before planning")
    assert warning < stopped
    assert "2x4, 4x2 (or 8)" in err


def _spy_solves(monkeypatch):
    import autoshard.intra.problem.build as problem

    budgets, real = [], problem.auto_shard_graph

    def spy(graph, mesh, options, **kw):
        budgets.append(options.memory_budget_bytes)
        return real(graph, mesh, options, **kw)

    monkeypatch.setattr(problem, "auto_shard_graph", spy)
    return budgets


def test_a_budget_that_does_not_bind_is_not_solved_under(monkeypatch):
    """The unbudgeted optimum fits a loose budget, so it is the budgeted optimum too: no
    ILP with memory rows is built (it made planning ~10x slower)."""
    from autoshard.api import plan_workload
    from autoshard.intra.problem.options import IntraOptions

    sizes = dict(batch_size=16, hidden=16)
    free = plan_workload("mlp", "2x4", options=IntraOptions(solver="highs"), **sizes)
    budgets = _spy_solves(monkeypatch)
    loose = IntraOptions(solver="highs", memory_budget_bytes=1e12)
    bound = plan_workload("mlp", "2x4", options=loose, **sizes)
    assert budgets == [None]
    assert bound.plan.objective == free.plan.objective
    assert bound.plan.predicted_peak_bytes <= 1e12


def test_a_budget_below_the_parameters_and_state_is_refused_before_any_solve(monkeypatch):
    from autoshard.api import plan_workload
    from autoshard.intra.ilp import InfeasibleBudgetError
    from autoshard.intra.problem.options import IntraOptions

    budgets = _spy_solves(monkeypatch)
    tight = IntraOptions(solver="highs", memory_budget_bytes=100.0)
    with pytest.raises(InfeasibleBudgetError, match="optimizer state alone take") as caught:
        plan_workload("mlp", "2x4", options=tight, batch_size=16, hidden=16)
    assert budgets == []
    assert caught.value.proven and caught.value.min_feasible_bytes > 100


def _spy_ilp_solves(monkeypatch):
    """The budgets of every ILP solve (the per-demand and the exact program's)."""
    import autoshard.intra.problem.build as problem
    import autoshard.intra.problem.exact_values as exact_values

    budgets = []
    for module in (problem, exact_values):
        real = module.solve

        def spy(pb, *a, _real=real, **k):
            budgets.append(pb.memory_budget_bytes)
            return _real(pb, *a, **k)

        monkeypatch.setattr(module, "solve", spy)
    return budgets


def _refusal(budget: float, progress=None):
    from autoshard.api import plan_workload
    from autoshard.intra.ilp import InfeasibleBudgetError
    from autoshard.intra.problem.options import IntraOptions

    options = IntraOptions(solver="highs", memory_budget_bytes=budget)
    with pytest.raises(InfeasibleBudgetError) as caught:
        plan_workload("mlp", "2x4", options=options, batch_size=16, hidden=16, progress=progress)
    return caught.value


@pytest.fixture(scope="module")
def mlp_budget_refusals():
    """The MLP's refusals the two tests below read: below the parameters and state (the
    state bound), 5% above it (the live-set bound, proven without solving), and just above
    that bound -- the budgeted solves near the least peak (~15 s), run once, their
    progress kept -- as ``(state, bound_refusal, least_refusal, progress_text)``."""
    import io

    from autoshard.inter.progress import Progress

    state = _refusal(1.0).min_feasible_bytes  # the state bound: refused before tracing on
    bounded = _refusal(state * 1.05)
    stream = io.StringIO()
    least = _refusal(bounded.lower_bound_bytes * 1.0001, Progress("plan", stream=stream))
    return state, bounded, least, stream.getvalue()


def test_a_budget_every_plan_peaks_over_is_refused_before_any_ilp(monkeypatch, mlp_budget_refusals):
    """Above the parameters and state, below what any plan's live set holds at the step's
    fullest point (each tensor split as far as its shardings go): refused with that bound,
    before any ILP (gpt-tiny's refusal took 6 min 19 s, then named no peak at all)."""
    state, _, least, _ = mlp_budget_refusals
    budgets = _spy_ilp_solves(monkeypatch)
    err = _refusal(state * 1.05)
    assert budgets == []
    assert err.proven and err.lower_bound_bytes == err.min_feasible_bytes > state * 1.05
    assert "or more" in str(err) and "proven without solving" in str(err)
    # the bound is a true bound: no plan the solver finds peaks under it (the budgeted
    # solves just above it, shared with the next test)
    assert least.min_feasible_bytes >= err.lower_bound_bytes


def test_a_binding_budget_says_so_before_the_slow_solves_and_names_the_least_peak(
    mlp_budget_refusals,
):
    """Between that bound and the least peak: a progress line when the budget binds (the
    solves under it can take minutes), then the least peak, in binary units with bytes."""
    _, bounded, err, said = mlp_budget_refusals
    bound = bounded.lower_bound_bytes
    assert "the plan without the budget peaks at" in said and "planning under the budget" in said
    assert err.proven and err.min_feasible_bytes > bound * 1.0001
    assert f"the least peak is {err.min_feasible_bytes / 2**10:.3g} KiB" in str(err)
    assert f"({err.min_feasible_bytes:,.0f} B)" in str(err)


def test_a_run_beyond_the_hosts_memory_is_refused_before_planning(capsys, monkeypatch):
    """run on CPU devices holds the state whole and again as shards, all in host memory
    (gpt-6.7b on 2 devices grew past 6 GB and went on): with less available than that,
    refused before planning, naming both sizes and what to do instead."""
    import autoshard.cli.plan as plan_cli
    import autoshard.cli.run as run_cli
    from autoshard.cli.main import main

    def no_plan(*a, **k):
        raise AssertionError("planned before checking the host's memory")

    monkeypatch.setattr(run_cli, "plan_from_args", no_plan)
    monkeypatch.setattr(plan_cli, "plan_from_args", no_plan)
    monkeypatch.setattr(run_cli, "available_host_bytes", lambda: 2048.0)
    assert main(["run", *MLP, "--mesh", "2x4", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "needs at least" in err and "2 KiB is available" in err
    assert "the shards of the 8 CPU devices" in err
    assert "`autoshard plan --model mlp --mesh 2x4`" in err and "Traceback" not in err
    # the sizes are the state's: mlp 16x16, SGD, as float32 (params, no state, batch)
    import jax

    from autoshard.models import get_workload, make_optimizer

    leaves = jax.tree_util.tree_leaves(
        get_workload("mlp", batch_size=16, hidden=16).abstract_train_args(make_optimizer("sgd"))
    )
    whole = sum(x.size * x.dtype.itemsize for x in leaves)
    assert f"needs at least {2 * whole / 2**10:.3g} KiB" in err


def test_a_time_limit_warning_names_the_objective_the_plan_prints(capsys, monkeypatch):
    """A solve stopped by its time limit warns with the objective its program charged; the
    plan printed is priced per value (or is a fallback), which can differ: 2x2x2 printed
    1.45819e+07 in the warning and 1.445e+07 in the plan. The warning names the plan's.
    (The stop is simulated: the solver's program charging 3% more than the plan costs. With
    ``one-axis`` the plan is that stopped plan priced per value; the default, "auto", goes on
    to solve this small program exactly and prints a cheaper plan.)"""
    import json
    import warnings

    import autoshard.intra.problem.build as problem
    from autoshard.cli.main import main
    from autoshard.intra.ilp import SolverTimeLimitWarning

    real = problem.solve

    def stopped(pb, *a, **k):
        solution = real(pb, *a, **k)
        warnings.warn(
            f"highs stopped with its best plan at time_limit_s=1: objective "
            f"{solution.objective * 1.03:.6g}, relative gap 0.5; raise the time limit "
            "(--time-limit) for a better plan",
            SolverTimeLimitWarning,
            stacklevel=2,
        )
        return solution

    monkeypatch.setattr(problem, "solve", stopped)
    assert main(["plan", *MLP, "--mesh", "2x4", "--exact-search", "one-axis", "--json"]) == 0
    captured = capsys.readouterr()
    objective = json.loads(captured.out)["objective"]
    assert f"the plan's objective {objective:.6g}" in captured.err
    assert f"charged its own plan {objective * 1.03:.6g}" in captured.err
    assert captured.err.count("autoshard: warning:") == 1  # held, issued once


def test_memory_figures_are_printed_in_binary_units_only(tmp_path, capsys):
    """plan, verify and explain write every memory figure in KiB/MiB/GiB (they mixed MB,
    kB and MiB: verify's table said 1.55MB and its note 1.6 MiB)."""
    import json
    import re

    from autoshard.cli.main import main

    argv = [*MLP, "--mesh", "2x4", "--baseline", "dp"]
    path = tmp_path / "p.json"
    assert main(["plan", *argv, "--out", str(path)]) == 0
    first = capsys.readouterr()
    assert main(["plan", *argv, "--json"]) == 0
    peak = json.loads(capsys.readouterr().out)["predicted_peak_bytes"]
    main(["plan", *argv])
    main(["verify", *argv])
    main(["explain", str(path)])
    said = capsys.readouterr()
    text = first.out + first.err + said.out + said.err
    decimal = re.findall(r"\d\s?(?:kB|KB|MB|GB|TB)\b", text)
    assert decimal == [], decimal
    line = re.search(r"predicted peak memory per device: ([0-9.]+) (KiB|MiB)\n", text)
    value, unit = float(line.group(1)), line.group(2)
    assert value == pytest.approx(peak / {"KiB": 2**10, "MiB": 2**20}[unit], rel=5e-3)
    assert re.search(r"peak memory per device: predicted [0-9.]+ KiB, compiled [0-9.]+ KiB", text)


# ------------------------------------------- exit statuses: 0 agree / fits, 1 does not


def test_simulate_of_a_model_that_does_not_fit_exits_1_without_a_speed(capsys):
    from autoshard.cli.main import main

    argv = ["simulate", "--model", "gpt-39b", "--cluster", "alpa-v100", "--gpus", "8"]
    assert main([*argv, "--plan", "megatron"]) == 1
    out = capsys.readouterr().out
    assert "OUT OF MEMORY" in out and "the step does not run" in out
    assert "tokens/s" not in out and "%" not in out.split("peak memory")[0]  # no MFU, no speed
    assert main([*argv, "--plan", "megatron", "--json"]) == 1
    assert '"oom": true' in capsys.readouterr().out
    assert main(["simulate", "--model", "gpt-125m", "--cluster", "dgx-a100", "--gpus", "8"]) == 0


def test_plan_verify_exits_1_on_a_disagreement_as_verify_does(monkeypatch, capsys):
    """A tolerance of 0 makes any memory error a disagreement: both commands say 1."""
    import dataclasses

    from autoshard.api import BoundPlan
    from autoshard.cli.main import main

    real = BoundPlan.verify
    monkeypatch.setattr(
        BoundPlan, "verify", lambda self, *a, **k: dataclasses.replace(real(self, *a, **k),
                                                                        memory_rtol=0.0)
    )  # fmt: skip
    argv = [*MLP, "--mesh", "2x4", "--baseline", "dp"]
    assert main(["verify", *argv]) == 1
    assert main(["plan", *argv, "--verify"]) == 1
    monkeypatch.setattr(BoundPlan, "verify", real)
    assert main(["plan", *argv, "--verify"]) == main(["verify", *argv])
    capsys.readouterr()


# ------------------------------------------ outputs checked before the work they record


@pytest.mark.parametrize("where", ["parent is a file", "read-only file system"])
def test_outputs_that_cannot_be_written_are_refused_before_the_work(
    tmp_path, where, capsys, monkeypatch
):
    import autoshard.cli.plan as plan_cli
    from autoshard.cli.main import main

    def no_work(*a, **k):
        raise AssertionError("worked before checking the output path")

    monkeypatch.setattr(plan_cli, "plan_from_args", no_work)
    if where == "parent is a file":
        (tmp_path / "file").write_text("x")
        bad = str(tmp_path / "file" / "out")
    else:
        bad = "/sys/autoshard-out"  # root writes any folder, not a read-only mount
    cases = [
        ["reproduce", "--out", bad],  # the experiments would run for minutes first
        ["plan", *MLP, "--mesh", "2x4", "--out", f"{bad}.json"],
        ["plan", "--model", "gpt-tiny", "--devices", "8", "--pipeline", "auto", "--out", bad],
        ["explain", "plan.json", "--html", f"{bad}.html"],
        ["explain", "plan.json", "--pictures", bad],
    ]
    for argv in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"autoshard: error: {argv[-2]} "), err
        assert "is a file, not a folder" in err or "cannot write in" in err
    assert not list(tmp_path.glob("**/.autoshard-probe-*"))


# ------------------------------------------------------------------------ smaller edges


def test_a_png_given_as_a_plan_names_the_file(tmp_path, capsys):
    from autoshard.cli.main import main

    png = tmp_path / "plan.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
    assert main(["explain", str(png)]) == 2
    err = capsys.readouterr().err
    assert f"plan file '{png}' is not text" in err and "utf-8" not in err


def test_a_plan_from_a_newer_version_says_upgrade(tmp_path):
    import json

    from autoshard.ir.planfile import PlanFileError, load_plan

    path = tmp_path / "new.json"
    path.write_text(json.dumps({"schema": "autoshard.plan/99", "kind": "intra"}))
    with pytest.raises(PlanFileError, match="a newer autoshard wrote it: upgrade autoshard"):
        load_plan(path)
    path.write_text(json.dumps({"schema": "autoshard.plan/0", "kind": "intra"}))
    with pytest.raises(PlanFileError, match="re-plan with this version"):
        load_plan(path)


def test_an_infinite_time_limit_is_refused_with_what_to_type(capsys):
    from autoshard.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", *MLP, "--mesh", "2x4", "--time-limit", "inf"])
    err = capsys.readouterr().err
    assert "got inf: give a finite one" in err and "None" not in err


def test_pipeline_plan_defaults_to_4_microbatches_as_plan_pipeline_does():
    from autoshard.cli.main import build_parser

    args = build_parser().parse_args(["pipeline-plan", "--model", "gpt-tiny"])
    assert args.microbatches == 4


def test_resumed_step_times_are_numbered_from_the_resume():
    from autoshard.cli.run import _step_times

    assert _step_times([0.5], done=1).startswith("step time: step 2 500.0 ms")
    assert "steps 3-4" in _step_times([0.5, 0.1, 0.1], done=1)
    assert _step_times([0.5, 0.1]).startswith("step time: step 1 ") and "; step 2 " in (
        _step_times([0.5, 0.1])
    )


def test_help_lists_every_cluster_preset(capsys):
    from autoshard.cli.main import build_parser
    from autoshard.hardware.clusters import available_presets

    for command in ("plan", "simulate", "explain"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        for name in available_presets():
            assert name in out, (command, name)


def test_export_differences_fold_identical_layers_only():
    from autoshard.cli.explain import fold_differences
    from autoshard.report.export import TensorDifference, state_path

    rows = [
        TensorDifference("Conv_0/kernel", "param", "f32[3, 3, 3, 16@model]", "f32[3, 3, 3, 16]"),
        TensorDifference("Conv_1/kernel", "param", "f32[3, 3, 16, 32@model]", "f32[3, 3, 16, 32]"),
        TensorDifference("block_0/w", "param", "f32[8@model]", "f32[8]"),
        TensorDifference("block_1/w", "param", "f32[8@model]", "f32[8]"),
    ]
    assert [(p, n) for p, _, _, n in fold_differences(rows)] == [
        ("Conv_0/kernel", 1), ("Conv_1/kernel", 1), ("block_*/w", 2)
    ]  # fmt: skip
    assert state_path("[1][0].mu['params']['Dense_0']['kernel']") == (
        "opt_state/mu/params/Dense_0/kernel"
    )
    assert state_path("[1][0].trace['block_0']['w']") == "opt_state/trace/block_0/w"


def test_no_highs_licence_banner_on_a_plans_output():
    proc = subprocess.run(
        [sys.executable, "-m", "autoshard", "plan", *MLP, "--mesh", "2x4", "--solver", "highs"],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr
    assert "HiGHS" not in proc.stderr + proc.stdout and "licence" not in proc.stderr


def test_a_ctrl_c_python_drops_in_a_gc_callback_still_ends_the_command():
    """Python drops an exception raised in a garbage-collector callback ("Exception
    ignored in ... _xla_gc_callback"): a Ctrl-C landing in jax's callback (its import, a
    trace) was lost and the command ran on (a fresh clone's CI: 100,000 steps and status 0).
    The hook the entry point installs ends the process with the one line and 130; the same
    program without it runs on to its end."""
    program = (
        "import gc, sys\n"
        "{install}"
        "def callback(phase, info):\n"
        "    raise KeyboardInterrupt\n"
        "gc.callbacks.append(callback)\n"
        "gc.collect()\n"
        "print('ran on')\n"
    )
    install = (
        "from autoshard.cli.interrupt import install_interrupt_hook\ninstall_interrupt_hook()\n"
    )
    runs = {
        hooked: subprocess.run(
            [sys.executable, "-c", program.format(install=install if hooked else "")],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=120,
        )
        for hooked in (True, False)
    }
    assert runs[True].returncode == 130, runs[True].stderr
    assert runs[True].stderr.count("autoshard: interrupted (Ctrl-C)") == 1
    assert "ran on" not in runs[True].stdout
    assert runs[False].returncode == 0 and "ran on" in runs[False].stdout


def test_a_pipeline_plan_on_a_cluster_fits_its_hbm_or_says_what_would(capsys):
    """``plan --pipeline --cluster`` takes the preset's HBM per device as its budget, as a
    one-mesh plan does (it had planned gpt-39b at 126 GiB per device on 16 GB V100s without
    a word): the JSON names the budget and every stage fits it; a model no plan fits exits
    2 with the least budget in GiB and what could make it fit."""
    import json

    from conftest import cli_in_process

    from autoshard.hardware.clusters import load_cluster

    hbm = load_cluster("alpa-v100").device.hbm_bytes
    tiny = "plan --model gpt-tiny --devices 2 --pipeline auto --microbatches 2 --batch 8"
    rc, out, _ = cli_in_process(capsys, *tiny.split(), "--cluster", "alpa-v100", "--json")
    plan = json.loads(out)
    assert rc == 0 and plan["memory_budget_bytes"] == hbm
    assert all(0 < s["peak_bytes"] <= hbm for s in plan["stages"])
    rc, out, _ = cli_in_process(capsys, *tiny.split(), "--json")  # no cluster: no budget
    assert rc == 0 and json.loads(out)["memory_budget_bytes"] is None
    huge = tiny.replace("--microbatches 2 --batch 8", "--microbatches 1 --batch 4194304")
    rc, _, err = cli_in_process(capsys, *huge.split(), "--cluster", "alpa-v100")
    assert rc == 2
    assert "fits 1.718e+10 bytes per device (16 GiB)" in err
    assert "the alpa-v100 preset's HBM, the default budget with --cluster" in err
    assert "--microbatches" in err and "--offload auto" in err


def test_a_pipeline_plan_is_the_plan_simulate_prices(capsys, tmp_path):
    """``plan --pipeline`` and ``simulate --plan auto`` run the same stage search: on a
    cluster whose HBM makes one stage recompute, both give the same stages, recompute
    modes, peaks and step time (they had disagreed on what fits: ``plan`` searched no
    recompute). bf16 on both sides (simulate's fp16 on V100)."""
    import json
    from importlib import resources

    from conftest import cli_in_process

    from autoshard.hardware.clusters import PRESET_DIR, PRESET_PACKAGE

    text = (resources.files(PRESET_PACKAGE) / PRESET_DIR / "alpa-v100.json").read_text()
    preset = json.loads(text)
    # 950,000 B: the first stage must recompute on jax 0.10 and 0.12 alike (full recompute:
    # 916,672 / 915,648 B); at 1,050,000 jax 0.12's plan without recompute (1,049,792 B)
    # fit once the weights were cast once a step
    preset["name"], preset["device"]["hbm_bytes"] = "small-v100", 950_000
    cluster = tmp_path / "small-v100.json"
    cluster.write_text(json.dumps(preset))
    rc, out, err = cli_in_process(
        capsys, *"simulate --model gpt-tiny --gpus 4 --global-batch 8 --plan auto".split(),
        "--microbatches", "2", "--dtype", "fp16", "--cluster", str(cluster), "--json", "--quiet",
    )  # fmt: skip
    assert rc == 0, err
    sim = json.loads(out)
    assert not sim["oom"]
    rc, out, err = cli_in_process(
        capsys, *"plan --model gpt-tiny --devices 4 --batch 8 --pipeline auto".split(),
        "--microbatches", "2", "--dtype", "bfloat16", "--cluster", str(cluster), "--json",
        "--quiet",
    )  # fmt: skip
    assert rc == 0, err
    plan = json.loads(out)
    assert any(s["recompute"] != "none" for s in plan["stages"])  # the budget binds
    assert plan["objective_s"] == pytest.approx(sim["step_time_s"], rel=1e-9)
    got = [(s["layers"][0], s["layers"][-1], s["submesh"], s["logical_mesh"], s["recompute"],
            s["peak_bytes"]) for s in plan["stages"]]  # fmt: skip
    want = [(s["layers"][0], s["layers"][-1], s["submesh"], s["logical_mesh_dp_tp"],
             s["recompute"], s["peak_bytes"]) for s in sim["plan"]["stages"]]  # fmt: skip
    assert got == want


# 2 devices by default; 4 (each stage search about twice as long) in CI's heavy step
@pytest.mark.parametrize("devices", [2, pytest.param(4, marks=pytest.mark.heavy)])
def test_a_pipeline_plan_searches_the_microbatch_count_it_is_given(capsys, devices):
    """``plan --pipeline --microbatches 2,4`` runs the whole stage search at each count and
    keeps the fastest plan that fits (the JSON lists every count tried); none fitting exits
    2 with the least budget over the counts; a count that does not divide the batch, and a
    search on ``run``, are refused."""
    import json

    from conftest import cli_in_process

    tiny = f"plan --model gpt-tiny --devices {devices} --pipeline auto --batch 8 --json --quiet"
    rc, out, err = cli_in_process(capsys, *tiny.split(), "--microbatches", "2,4")
    assert rc == 0, err
    plan = json.loads(out)
    tried = plan["microbatch_search"]
    assert [r["num_microbatches"] for r in tried] == [2, 4] and all(r["fits"] for r in tried)
    best = min(tried, key=lambda r: r["objective_s"])
    assert [r["chosen"] for r in tried] == [r is best for r in tried]
    assert plan["num_microbatches"] == best["num_microbatches"]
    assert plan["objective_s"] == best["objective_s"]
    rc, _, err = cli_in_process(
        capsys, *tiny.split(), "--microbatches", "2,4", "--memory-budget", "1e-6"
    )
    assert rc == 2 and "the least over micro-batch counts 2, 4" in err
    rc, _, err = cli_in_process(capsys, *tiny.split(), "--microbatches", "3,search")
    assert rc == 2 and "does not divide the global batch 8" in err
    # search's default count on a cluster preset: simulate's, at the device's 16-bit dtype
    # (a V100 has no bf16: fp16)
    rc, out, err = cli_in_process(
        capsys, *tiny.split(), "--microbatches", "search", "--dtype", "bfloat16",
        "--cluster", "alpa-v100",
    )  # fmt: skip
    assert rc == 0, err
    assert len(json.loads(out)["microbatch_search"]) >= 2
    rc, _, err = cli_in_process(
        capsys,
        *f"run --model gpt-tiny --devices {devices} --pipeline auto --microbatches search".split(),
    )
    assert rc == 2 and "--microbatches" in err


# 8 devices: heavy (CI's heavy step; its four stage searches take twice the 4 devices' time)
@pytest.mark.parametrize("devices", [4, pytest.param(8, marks=pytest.mark.heavy)])
def test_a_pipeline_plan_recomputes_where_its_budget_needs_it(capsys, devices):
    """``plan --pipeline`` lets the stage DP give each stage a recompute mode (default
    ``--recompute auto``, as ``simulate --plan auto``): where no plan without recompute
    fits the budget, the plan recomputes in some stage and fits; with ``--recompute none``
    the same budget exits 2 and the message names ``--recompute``. With no budget no
    stage recomputes (recompute only adds time)."""
    import json
    import re

    from conftest import cli_in_process

    tiny = (
        f"plan --model gpt-tiny --devices {devices} --pipeline auto --microbatches 2 --json --quiet"
    )
    rc, out, _ = cli_in_process(capsys, *tiny.split())
    assert rc == 0 and {s["recompute"] for s in json.loads(out)["stages"]} == {"none"}
    rc, _, err = cli_in_process(
        capsys, *tiny.split(), "--recompute", "none", "--memory-budget", "1e-6"
    )
    assert rc == 2 and "--recompute auto or full (none now)" in err
    least = float(re.search(r"admits one is ([0-9.e+]+) bytes", err).group(1))
    budget = least * 0.98 / 2**30  # just under what the plan without recompute needs
    rc, out, err = cli_in_process(capsys, *tiny.split(), "--memory-budget", f"{budget:.9f}")
    assert rc == 0, err
    stages = json.loads(out)["stages"]
    assert any(s["recompute"] != "none" for s in stages)
    assert all(s["peak_bytes"] <= budget * 2**30 for s in stages)
    rc, _, err = cli_in_process(
        capsys, *tiny.split(), "--recompute", "none", "--memory-budget", f"{budget:.9f}"
    )
    assert rc == 2 and "--recompute auto or full" in err


def test_exact_search_defaults_to_lp_and_refuses_other_values(capsys):
    """``--exact-search``: "lp" by default (its help says so, a "%" escaped), a value it
    does not know refused with the choices."""
    from autoshard.cli.main import build_parser

    args = build_parser().parse_args(["plan", *MLP, "--mesh", "2x4"])
    assert args.exact_search == "lp"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "lp, the default: up to 27% cheaper plans" in out
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["plan", *MLP, "--mesh", "2x4", "--exact-search", "exact"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'exact'" in err and "'lp', 'auto', 'one-axis'" in err
