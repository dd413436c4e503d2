"""The runnable examples under examples/ run, and do what their docs say."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_own_model_example_plans_runs_verifies_and_saves(tmp_path):
    out = tmp_path / "plan.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "own_model.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "agrees with XLA: True" in proc.stdout
    losses = re.findall(r"loss ([\d.]+) sharded, ([\d.]+) on one device", proc.stdout)
    assert len(losses) == 3
    for got, want in losses:  # sharded == one device, to the printed digits (f32, AdamW)
        assert abs(float(got) - float(want)) <= 2e-6 + 1e-5 * abs(float(want))
    assert float(losses[2][0]) < float(losses[0][0])  # it trains
    doc = json.loads(out.read_text())
    assert doc["schema"] == "autoshard.plan/1" and doc["inputs"]
    from autoshard.cli.main import main

    assert main(["explain", str(out), "--json"]) == 0
