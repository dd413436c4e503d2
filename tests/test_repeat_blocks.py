"""repeat_blocks: a deep GPT's trace records from its 3-block twin, checked record for
record against the real deep trace (the sorted pytree order of ``block_10`` before
``block_2`` needs more than 10 blocks)."""

import dataclasses

import pytest

from autoshard.api import trace_workload
from autoshard.api_pipeline import microbatch_graph, trace_microbatch
from autoshard.ir.repeat import repeat_blocks

SMALL = dict(batch_size=4, seq_len=16, hidden=64, num_heads=4, vocab_size=128)


def _records(num_layers, **kw):
    return trace_workload("gpt-tiny", **{**SMALL, **kw}, num_layers=num_layers).program.records


@pytest.mark.parametrize("kw", [{}, {"attention": "fused", "qkv_gemms": 3}])
def test_three_blocks_repeated_are_the_deep_trace(kw):
    shallow = _records(3, **kw)
    for layers in (4, 12):
        assert repeat_blocks(shallow, layers) == _records(layers, **kw)


def test_the_plan_path_traces_three_blocks_and_gets_the_deep_graph(monkeypatch):
    import autoshard.api_stage_plan as api

    monkeypatch.delenv("AUTOSHARD_CACHE_DIR", raising=False)
    full = trace_microbatch("gpt-tiny", 2, **SMALL, num_layers=6).graph
    depths = []
    real = api.trace_microbatch

    def counting(*args, **kwargs):
        depths.append(kwargs["num_layers"])
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "trace_microbatch", counting)
    name, graph = microbatch_graph("gpt-tiny", 2, **SMALL, num_layers=6)
    assert depths == [3] and name == "gpt-tiny"
    assert graph.nodes == full.nodes and graph.tensors == full.tensors
    assert graph.layers == full.layers and graph.inputs == full.inputs


def test_what_it_cannot_repeat_is_refused():
    shallow = _records(3)
    with pytest.raises(ValueError, match="first, 3 blocks, last"):
        repeat_blocks(_records(2), 8)
    with pytest.raises(ValueError, match=">= 3 blocks"):
        repeat_blocks(shallow, 2)
    # the head reading the middle block: which deep block would it read?
    mid = next(e for e in shallow.eqns if e.layer == "block_1" and e.phase == "forward")
    head = next(i for i, e in enumerate(shallow.eqns) if e.layer == "head")
    eqns = list(shallow.eqns)
    eqns[head] = dataclasses.replace(eqns[head], inputs=(mid.outputs[0], *eqns[head].inputs[1:]))
    with pytest.raises(ValueError, match="outside the blocks reads a middle block"):
        repeat_blocks(dataclasses.replace(shallow, eqns=tuple(eqns)), 8)
