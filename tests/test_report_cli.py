"""The command line keeps its word: one JSON document per --json, whichever solver runs;
--version; --help lists the presets and defaults; run --json and step times."""

import json
import subprocess
import sys

import pytest
from conftest import cli_in_process

from autoshard.cli.main import build_parser, main

# batch 128: the 2x4 plans solve in well under a second (batch 64 with hidden 32 is a slow
# case of HiGHS's exact program: 3.8 s with SGD, 6.1 s with AdamW, of CPU per plan)
MLP = "--model mlp --batch 128 --hidden 32"


def _run(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "autoshard", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "argv",
    [f"inspect {MLP}"]
    + [
        cmd.format(solver=solver)
        for solver in ("cbc", "highs")
        for cmd in (
            f"verify {MLP} --mesh 2x4 --solver {{solver}}",
            f"run {MLP} --mesh 2x4 --solver {{solver}} --check --steps 2",
            "plan --model gpt-tiny --layers 2 --devices 8 --pipeline equal-layer --stages 2 "
            "--microbatches 2 --solver {solver}",
        )
    ],
)  # plan (one mesh) and simulate: tests/test_cli.py, with both solvers
def test_every_json_is_one_document(argv):
    proc = _run(*argv.split(), "--json")
    # verify exits 1 when a prediction disagrees with XLA; its JSON says which
    assert proc.returncode == 0 or (argv.startswith("verify") and proc.returncode == 1)
    assert "Traceback" not in proc.stderr
    doc = json.loads(proc.stdout)  # the whole of stdout, nothing before or after
    assert isinstance(doc, dict) and doc


def test_run_json_has_losses_step_times_and_check(capsys):
    # in this process (the one-document stdout of run --json in a fresh one: above)
    argv = f"run {MLP} --mesh 2x4 --solver highs --check --steps 3 --json"
    rc, out, err = cli_in_process(capsys, *argv.split())
    assert rc == 0, err
    doc = json.loads(out)
    assert len(doc["losses"]) == 3 and len(doc["step_seconds"]) == 3
    assert all(s > 0 for s in doc["step_seconds"])
    assert doc["check"]["ok"] is True and doc["check"]["rtol"] == 1e-5


def test_inspect_says_which_batch_its_flops_are_for(capsys):
    rc, out, err = cli_in_process(capsys, *"inspect --model gpt-tiny --batch 4 --seq 16".split())
    assert rc == 0, err
    assert "global batch 4, sequence 16" in out and "FLOP" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("autoshard ")


def test_help_lists_presets_and_defaults():
    from autoshard.cli.args import MODEL_PRESETS
    from autoshard.models import model_names

    assert list(MODEL_PRESETS) == model_names()  # the parser's copy is the models' list
    sub = build_parser()._subparsers._group_actions[0].choices
    text = sub["run"].format_help()
    assert "gpt-39b" in text and "mlp" in text
    assert "(default: 2)" in text  # --steps
    assert "(default: 1e-05)" in text  # --rtol
    assert "(default: None)" not in text


def test_plan_prints_its_parallelism_in_words_and_objective_unit(capsys):
    argv = f"plan {MLP} --mesh 2x4 --baseline megatron --solver highs"
    rc, out, err = cli_in_process(capsys, *argv.split())
    assert rc == 0, err
    assert "in words: 1 stage x (DP 2 over data, TP 4 over model), no recompute" in out
    assert "Alpa's relative cost units" in out


def test_tables_are_full_width_when_piped(tmp_path, capsys):
    from autoshard.api import plan_workload
    from autoshard.intra.problem.options import IntraOptions

    path = tmp_path / "p.json"
    opts = IntraOptions(solver="highs")
    plan_workload("mlp", "2x4", options=opts, batch_size=128, hidden=32).save(path)
    assert main(["explain", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) > 80  # rich alone would cut a pipe at 80
    assert not any("…" in line for line in lines)  # no column cut short


def test_a_toml_config_stands_in_for_flags_and_typed_flags_win(tmp_path, capsys):
    config = tmp_path / "autoshard.toml"
    config.write_text(
        '[plan]\nmodel = "mlp"\nbatch = 64\nhidden = 32\nmesh = "2x4"\nsolver = "highs"\n'
        'baseline = "megatron"\njson = true\n\n[run]\nsteps = 5\n'
    )
    assert main(["--config", str(config), "plan"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"] == "megatron" and doc["mesh"]["shape"] == [2, 4]
    assert doc["fingerprint"]["overrides"] == {"batch_size": 64, "hidden": 32}
    assert main(["--config", str(config), "plan", "--baseline", "dp"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"] == "dp"


@pytest.mark.parametrize(
    "text, message",
    [
        (
            '[plan]\nmodle = "mlp"\n',
            "[plan] has no flag 'modle'; it takes attention, baseline, batch",
        ),
        ("[plan\n", "is not valid TOML"),
        ('[plna]\nmodel = "mlp"\n', "'plna' is not a [command] table"),
        ("[plan]\nmesh = true\n", "[plan] mesh takes a value, not True"),
    ],
)
def test_bad_config_files_are_clear(tmp_path, capsys, text, message):
    config = tmp_path / "bad.toml"
    config.write_text(text)
    assert main(["--config", str(config), "plan"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_quiet_before_or_after_the_command():
    parser = build_parser()
    assert parser.parse_args(["--quiet", "inspect", "--model", "mlp"]).quiet is True
    assert parser.parse_args(["inspect", "--model", "mlp", "--quiet"]).quiet is True
    assert not hasattr(parser.parse_args(["inspect", "--model", "mlp"]), "quiet")


def test_no_spinner_when_stderr_is_not_a_terminal(capsys):
    import argparse

    from autoshard.cli.console import progress

    with progress(argparse.Namespace(), "working ..."):
        pass
    assert capsys.readouterr().err == ""  # pipes and logs stay clean


def test_readme_round_trip_save_explain_export_run(tmp_path, capsys):
    """The README's "Save, explain, export" steps, on a small model."""
    plan, page, pics = tmp_path / "plan.json", tmp_path / "plan.html", tmp_path / "pics"
    argv = f"plan {MLP} --mesh 2x4 --optimizer sgd --solver highs --out {plan}"
    assert main(argv.split()) == 0
    assert main(["explain", str(plan), "--html", str(page), "--pictures", str(pics)]) == 0
    assert page.exists() and sorted(p.name for p in pics.glob("*.png")) == [
        "memory.png",
        "mesh.png",
        "tensor.png",
    ]
    assert main(["export", str(plan), "--to", "megatron"]) == 0
    capsys.readouterr()
    assert main(["run", "--plan", str(plan), "--steps", "2", "--check", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["check"]["ok"] is True and len(doc["losses"]) == 2
