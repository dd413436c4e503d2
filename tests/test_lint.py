"""The linter and formatter run with the tests (and so in CI)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ruff(*args):
    """The ruff installed beside this Python (the dev extra's), not one found on PATH."""
    cmd = [sys.executable, "-m", "ruff", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_check():
    proc = _ruff("check", "autoshard", "tests", "benchmarks", "experiments")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format():
    proc = _ruff("format", "--check", "autoshard", "tests", "benchmarks", "experiments")
    assert proc.returncode == 0, proc.stdout + proc.stderr
