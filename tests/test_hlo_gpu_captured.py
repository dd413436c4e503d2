"""Real XLA:GPU captures (one H100, jax 0.11.2, 2026-11-27) read as the GPU run read them.

The compiled HLO of the gpt-tiny rows of ``benchmarks/results/gpu_truth_h100_2026-11-27.json``
(tests/fixtures/xla_gpu/h100_2026-11-27/, README there) against what that JSON recorded:

* bytes per (kind, axes) equal the recorded compiled bytes, and the number of collective
  operations (one per instruction, one per operand of a tuple-combined one) the recorded
  compiled count, which the verifier of that run gave;
* one record per reduced value: the all-reduces XLA:GPU combines by concatenation are read
  piece by piece, so the counts equal the plan's predicted counts (they did not before);
* the same module with every asynchronous pair rewritten into its sync form (XLA:CPU's
  spelling) reads alike, normalisations included.
"""

import gzip
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from autoshard.ir.spec import Mesh
from autoshard.verify.collectives import analyze_collectives
from autoshard.verify.hlo import _parse_module

ROOT = Path(__file__).resolve().parents[1]
CAPTURES = ROOT / "tests" / "fixtures" / "xla_gpu" / "h100_2026-11-27"
RESULTS = ROOT / "benchmarks" / "results" / "gpu_truth_h100_2026-11-27.json"
MESH = Mesh(("data", "model"), (2, 4))
ROWS = ("gpt-tiny-L2-auto-2x4", "gpt-tiny-L2-zero3-2x4")
CONCATENATED = "of an all-reduce combined by concatenation"


def _text(name: str) -> str:
    return gzip.open(CAPTURES / f"{name}.hlo.txt.gz", "rt").read()


def _recorded(name: str) -> dict:
    rows = {r["name"]: r for r in json.loads(RESULTS.read_text())["rows"]}
    return {(r["kind"], tuple(r["axes"])): r for r in rows[name]["collectives"]}


def _key(c):
    return c.collective.kind, tuple(sorted(c.collective.axes))


@pytest.mark.parametrize("name", ROWS)
def test_captured_module_reads_the_bytes_and_operations_the_gpu_run_recorded(name):
    found = analyze_collectives(_text(name), MESH, range(8))
    recorded = _recorded(name)
    nbytes, ops = Counter(), {}
    for c in found.collectives:
        nbytes[_key(c)] += c.collective.bytes
        # an operation: an instruction, or one operand of a tuple-combined instruction
        op = c.hlo_name if CONCATENATED in c.note else (c.hlo_name, c.note)
        ops.setdefault(_key(c), set()).add(op)
    assert set(nbytes) == set(recorded)
    for key, row in recorded.items():
        assert nbytes[key] == row["compiled_bytes"], key
        assert len(ops[key]) == row["compiled_count"], key


@pytest.mark.parametrize("name", ROWS)
def test_concatenated_all_reduces_are_read_one_value_each_as_the_plan_predicts(name):
    found = analyze_collectives(_text(name), MESH, range(8))
    pieces = [c for c in found.collectives if CONCATENATED in c.note]
    assert pieces, f"{name}: XLA:GPU combined no all-reduce by concatenation; nothing tested"
    assert {c.collective.kind for c in pieces} == {"all-reduce"}
    counts = Counter(_key(c) for c in found.collectives)
    recorded = _recorded(name)
    # the capture-time reader counted each concatenation once: fewer than predicted
    assert any(r["compiled_count"] < r["predicted_count"] for r in recorded.values())
    assert counts == Counter({k: r["predicted_count"] for k, r in recorded.items()})
    # every piece's bytes are one concatenated operand's, and they add up to the buffer
    mod = _parse_module(_text(name))
    for hlo_name in {c.hlo_name for c in pieces}:
        total = sum(c.collective.bytes for c in pieces if c.hlo_name == hlo_name)
        operand = mod.instrs[mod.instrs[hlo_name].operands[0]]
        dims = re.search(r"\[(\d+)\]", operand.shape).group(1)
        assert total == 4 * int(dims), hlo_name  # f32 buffers


def to_sync(text: str) -> str:
    """Every ``X-start`` / ``X-done`` pair of XLA:GPU's printed module as XLA:CPU's sync
    ``X`` (with the done's shape: the result), its done a bitcast of it."""
    mod = _parse_module(text)
    assert not any(i.opcode in ("async-start", "async-update") for i in mod.instrs.values())
    starts = {}
    for ins in mod.instrs.values():
        if ins.opcode.endswith("-done"):
            start = mod.instrs[ins.operands[0]]
            assert start.opcode == ins.opcode[: -len("done")] + "start", (ins.name, start.opcode)
            starts[start.name] = ins
    lines = []
    for line in text.splitlines():
        m = re.match(r"^(\s*)(ROOT )?%([\w.\-]+) = ", line)
        ins = mod.instrs.get(m.group(3)) if m else None
        if ins is not None and ins.name in starts:
            opcode = ins.opcode[: -len("-start")]
            done = starts[ins.name]
            line = f"{m.group(1)}%{ins.name} = {done.shape} {opcode}({ins.operand_text}){ins.attrs}"
        elif ins is not None and ins.opcode.endswith("-done"):
            line = f"{m.group(1)}{m.group(2) or ''}%{ins.name} = {ins.shape} bitcast(%{ins.operands[0]})"
        lines.append(line)
    return "\n".join(lines)


@pytest.mark.parametrize("name", ROWS)
def test_captured_module_in_sync_forms_reads_alike(name):
    text = _text(name)
    sync = to_sync(text)
    assert "-start(" in text and "-start(" not in sync and "-done(" not in sync
    mod = _parse_module(sync)
    assert not any(i.opcode.endswith(("-start", "-done")) for i in mod.instrs.values())

    def read(t):
        found = analyze_collectives(t, MESH, range(8))
        return sorted(
            (c.collective.kind, c.collective.axes, c.collective.bytes, c.dtype, c.in_loop, c.note)
            for c in found.collectives
        )

    async_read, sync_read = read(text), read(sync)
    assert async_read == sync_read
    assert len(async_read) == sum(r["predicted_count"] for r in _recorded(name).values())
