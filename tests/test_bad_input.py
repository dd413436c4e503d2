"""Every bad input in docs/bad-input.md gets its message and exit status 2, no traceback.

Run in-process (``main(argv)``) on the 8 fake devices of conftest; ``{plan}`` and the other
names in braces are files the fixture writes.
"""

import json

import pytest

from autoshard.cli.main import main

CASES = [
    ("explain {missing}", "cannot read plan file"),
    ("run --plan {missing}", "cannot read plan file"),
    ("export {broken} --to megatron", "is not valid JSON (line 2, column 1"),
    (
        "run --plan {edited_mesh}",
        "but its fingerprint says 4x2 (data, model) (the file was edited)",
    ),
    ("verify --plan {edited_key}", "the plan cannot be read (missing key 'input_specs')"),
    ("explain {old_schema}", "this autoshard reads 'autoshard.plan/1'"),
    ("export {no_inputs} --to megatron", "save it again with `autoshard plan ... --out`"),
    ("run --plan {plan} --model gpt-tiny", "--model gpt-tiny (the plan is for mlp)"),
    ("run --plan {plan} --batch 32", "--batch 32 (the plan is for --batch 128)"),
    ("run --plan {plan} --mesh 8x1", "the plan was made for mesh 2x4 (data, model), not 8x1"),
    ("run --plan {plan} --baseline dp", "drop --baseline"),
    ("plan --model gpt-3b --mesh 2x4", "unknown model 'gpt-3b'. Did you mean 'gpt-39b'?"),
    ("plan --model mlp --mesh 2by4", "is not a shape like 8, 2x4 or 1x8"),
    (
        "plan --model mlp --batch 64 --hidden 32 --mesh 2x4 --solver highs "
        "--memory-budget 0.000001",
        "raise the budget to at least that",
    ),
    ("plan --model mlp --mesh 2x4 --cluster dgx-z100", "unknown cluster preset 'dgx-z100'"),
    ("run --model mlp --mesh 2x4 --rtol -1", "--rtol: expected a positive number, got -1"),
    ("plan --model mlp --mesh 2x4 --time-limit 0", "--time-limit: expected a positive number"),
    ("plan --model mlp --mesh 2x4 --memory-budget -2", "--memory-budget: expected a positive"),
    ("plan --model gpt-tiny --mesh 2x4 --pipeline auto", "not both"),
    ("run --model gpt-tiny --devices 8 --pipeline auto --json", "does not use --json"),
    ("run --model gpt-tiny --devices 8 --pipeline auto --cluster dgx-a100", "--cluster"),
    ("run --model gpt-tiny --devices 8 --pipeline auto --memory-budget 1", "--memory-budget"),
    ("run --model gpt-tiny --devices 8 --pipeline auto --time-limit 5", "--time-limit"),
    ("plan --model gpt-tiny --devices 8 --pipeline auto --verify", "does not use --verify"),
    ("plan --model gpt-tiny --devices 8 --pipeline auto --merge-elementwise", "do not merge"),
    ("run --plan {pipeline}", "is a pipeline plan: `autoshard explain` and `autoshard export`"),
    ("plan --model mlp --mesh 2x4 --microbatches 4", "--microbatches set pipeline stages"),
    ("run --plan {plan} --schedule gpipe", "drop --schedule"),
    ("export {plan} --to alpa", "invalid choice: 'alpa'"),
    ("explain {plan} --tensor nope --pictures {pics}", "--tensor 'nope' matches no input"),
    ("explain {plan} --cluster dgx-a100", "--cluster simulates GPT presets"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from autoshard.api import plan_workload
    from autoshard.intra.problem.options import IntraOptions

    tmp = tmp_path_factory.mktemp("bad")
    plan = tmp / "p.json"
    plan_workload(
        "mlp", "2x4", options=IntraOptions(solver="highs"), batch_size=128, hidden=32
    ).save(plan)
    doc = json.loads(plan.read_text())

    def edited(name, edit):
        d = json.loads(json.dumps(doc))
        edit(d)
        (tmp / name).write_text(json.dumps(d))
        return str(tmp / name)

    (tmp / "broken.json").write_text('{"schema": \n')
    pipeline = {"schema": doc["schema"], "kind": "pipeline", "fingerprint": {}, "inter_plan": {}}
    (tmp / "pipeline.json").write_text(json.dumps(pipeline))
    return {
        "plan": str(plan),
        "missing": str(tmp / "missing.json"),
        "broken": str(tmp / "broken.json"),
        "edited_mesh": edited("mesh.json", lambda d: d["fingerprint"]["mesh"].update(shape=[4, 2])),
        "edited_key": edited("key.json", lambda d: d["parallel_plan"].pop("input_specs")),
        "old_schema": edited("old.json", lambda d: d.update(schema="autoshard.plan/0")),
        "no_inputs": edited("noinputs.json", lambda d: d.pop("inputs")),
        "pipeline": str(tmp / "pipeline.json"),
        "pics": str(tmp / "pics"),
    }


@pytest.mark.parametrize("command, message", CASES)
def test_bad_input_gets_its_message(files, command, message, capsys):
    try:
        rc = main(command.format(**files).split())
    except SystemExit as stop:  # argparse refuses a flag's value this way
        rc = stop.code
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err, err
    assert "Traceback" not in err
