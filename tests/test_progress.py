"""Search progress: rate-limited lines on stderr, terminal or not; --json stays one document."""

import io
import json
import os
import re
import subprocess
import sys

from autoshard.inter.progress import Progress


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_silent_before_the_quiet_period_then_rate_limited():
    clock, out = FakeClock(), io.StringIO()
    p = Progress("search", stream=out, after_s=2.0, every_s=5.0, clock=clock)
    with p.phase("stage ILPs", 1000) as phase:
        for _ in range(1000):
            clock.now += 0.03  # 30 s in all
            phase.advance()
    lines = out.getvalue().splitlines()
    # nothing in the first 2 s; then one line per 5 s at most, and the closing line
    assert 2 <= len(lines) <= 30 / 5 + 2, lines
    assert lines[-1] == "search: stage ILPs 1,000/1,000 done, 30 s"
    first = re.fullmatch(r"search: stage ILPs ([\d,]+)/1,000, (\d+) s", lines[0])
    assert first and int(first[2]) >= 2 and int(first[1].replace(",", "")) < 1000


def test_a_short_search_prints_nothing_and_quiet_prints_nothing():
    clock, out = FakeClock(), io.StringIO()
    p = Progress(stream=out, after_s=2.0, clock=clock)
    with p.phase("stage spans", 10) as phase:
        for _ in range(10):
            clock.now += 0.1
            phase.advance()
    assert out.getvalue() == ""
    q = Progress(stream=out, after_s=0.0, enabled=False, clock=clock)
    with q.phase("trace"):
        clock.now += 10
    assert out.getvalue() == ""


def test_cli_search_progress_goes_to_a_piped_stderr_and_json_stays_one_document():
    env = dict(os.environ, AUTOSHARD_PROGRESS_AFTER_S="0")
    argv = "plan --model gpt-tiny --layers 4 --devices 8 --pipeline auto --microbatches 4 --json"
    proc = subprocess.run(
        [sys.executable, "-m", "autoshard", *argv.split()],
        capture_output=True,  # stderr is a pipe, not a terminal
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    json.loads(proc.stdout)  # exactly one document
    lines = [x for x in proc.stderr.splitlines() if x.startswith("gpt-tiny: ")]
    assert any(re.fullmatch(r"gpt-tiny: trace done, \d+ s", x) for x in lines), proc.stderr
    ilps = [re.fullmatch(r"gpt-tiny: stage ILPs (\d+)/(\d+) done, \d+ s", x) for x in lines]
    done = [m for m in ilps if m]
    assert len(done) == 1 and done[0][1] == done[0][2] and int(done[0][2]) > 0, proc.stderr
    assert any(x.startswith("gpt-tiny: stage spans ") for x in lines)
    assert any(x.startswith("gpt-tiny: stage DP runs done") for x in lines)
    assert len(lines) < 40  # a line per phase, not one per ILP or span
