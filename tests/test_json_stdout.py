"""Every command's ``--json`` prints exactly one JSON document on stdout, nothing else.

In-process with ``capfd`` (descriptor 1 itself is captured, so what C or C++ libraries
print there counts too) on the 8 fake devices of conftest, and the multi-process run as
a subprocess (Gloo prints its connection lines on descriptor 1 from its own threads).
Smallest settings: mlp with hidden 16, gpt-tiny with 2 layers.
"""

import json
import os
import subprocess
import sys

import pytest

from autoshard.cli.main import main

MLP = "--model mlp --batch 16 --hidden 16"


def _json_stdout(argv: str, capfd, statuses=(0,)) -> dict:
    rc = main(argv.split())
    out, err = capfd.readouterr()
    assert rc in statuses, err
    return json.loads(out)  # the whole of stdout, nothing before or after


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("json")
    one, pipe = tmp / "one.json", tmp / "pipe.json"
    assert main(f"plan {MLP} --mesh 2x4 --solver highs --out {one} --json".split()) == 0
    argv = (
        "plan --model gpt-tiny --layers 2 --devices 8 --pipeline equal-layer --stages 2 "
        f"--microbatches 2 --solver highs --out {pipe} --json"
    )
    assert main(argv.split()) == 0
    return {"one": one, "pipe": pipe}


COMMANDS = [
    f"inspect {MLP} --json",
    f"plan {MLP} --mesh 2x4 --baseline dp --json",
    f"verify {MLP} --mesh 2x4 --baseline dp --json",
    f"run {MLP} --mesh 2x4 --steps 1 --json",
    "plan --model gpt-tiny --layers 2 --devices 8 --pipeline equal-layer --stages 2 "
    "--microbatches 2 --json",
    "pipeline-plan --model gpt-tiny --layers 2 --hosts 1 --devices-per-host 8 --pipeline "
    "equal-layer --stages 2 --microbatches 2 --json",
    "simulate --model gpt-125m --cluster dgx-a100 --gpus 2 --plan megatron --json",
    "explain {one} --json",
    "explain {pipe} --json",
    "export {one} --to megatron --json",
    "export {pipe} --to deepspeed --json",
    "export {pipe} --to maxtext --json",
    "reproduce --list --json",
]


@pytest.mark.parametrize("argv", COMMANDS)
def test_json_stdout_is_one_document(plans, argv, capfd):
    _json_stdout(argv.format(**plans), capfd, statuses=(0, 1))  # 1: a disagreement, reported


def test_multi_process_json_stdout_is_one_document():
    proc = subprocess.run(
        [sys.executable, "-m", "autoshard", "run", *MLP.split(), "--mesh", "2", "--steps", "1"]
        + ["--processes", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["mesh"]["shape"] == [2] and len(out["losses"]) == 1
