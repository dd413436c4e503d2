"""A deep chain of identical blocks from the trace of a shallow one (jax-free).

Tracing GPT-39B's 48 blocks costs seconds of JAX and Flax work that repeats one block 48
times.  :func:`repeat_blocks` takes the records of the same step traced with three blocks
(``first, stem0, stem1, stem2, last``) and writes the records a trace of ``num_blocks``
blocks makes, equation for equation and id for id:

* every maximal run of consecutive equations of one block is a *run*; runs of the three
  blocks that follow one another (a *group*: a forward pass, a backward pass, one of the
  optimizer's passes over the parameters) are replaced by one run per deep block, in the
  group's order: ascending in the forward, descending in the backward, and pytree order
  (sorted names: ``block_0, block_1, block_10, ...``) in the update passes;
* deep block 0 repeats shallow block 0, the deep last block the shallow last block, every
  other deep block the middle shallow block; a value a block reads from its own block or a
  neighbour is read from the same relative deep block;
* tensor ids are given in the order the tracer gives them (program inputs in pytree
  order, then per equation: the literals and constants made for it, then its outputs).

It refuses (``ValueError``) whatever it cannot repeat exactly: a layer that reads from a
block other than a neighbour, an equation outside the blocks that reads a middle block
(a global-norm clip over all gradients), groups whose runs differ, a group not made of
all three blocks.  ``tests/test_repeat_blocks.py`` checks the result against a real trace
of the deeper step, record for record.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from autoshard.ir.records import EqnRecord, TensorRecord, TraceRecords

SHALLOW_BLOCKS = 3  # the trace repeat_blocks starts from: first, 3 blocks, last


def _block_names(layers: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """(stem, the block names) of ``first, stem0, stem1, stem2, last``, or ValueError."""
    if len(layers) != SHALLOW_BLOCKS + 2:
        raise ValueError(f"expected first, {SHALLOW_BLOCKS} blocks, last; got layers {layers}")
    blocks = tuple(layers[1:-1])
    stem = blocks[0].rstrip("0123456789")
    if stem == blocks[0] or blocks != tuple(f"{stem}{i}" for i in range(SHALLOW_BLOCKS)):
        raise ValueError(f"blocks {blocks} are not named {stem!r}0, {stem!r}1, {stem!r}2")
    return stem, blocks


def _path_block(path: str, stem: str) -> int | None:
    m = re.search(rf"\['{re.escape(stem)}(\d+)'\]", path)
    return None if m is None else int(m.group(1))


def _rename_path(path: str, stem: str, deep: int) -> str:
    return re.sub(rf"\['{re.escape(stem)}\d+'\]", f"['{stem}{deep}']", path, count=1)


def _rename_module(module_path: str, stem: str, deep: int) -> str:
    return "/".join(
        f"{stem}{deep}" if re.fullmatch(rf"{re.escape(stem)}\d+", p) else p
        for p in module_path.split("/")
    )


def _runs(tags: Sequence) -> list[tuple[int, int]]:
    """Maximal [start, end) runs of equal consecutive ``tags``."""
    runs, start = [], 0
    for i in range(1, len(tags) + 1):
        if i == len(tags) or tags[i] != tags[start]:
            runs.append((start, i))
            start = i
    return runs


def _deep_orders(num_blocks: int, stem: str) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Shallow order of a group's blocks -> the deep blocks' order."""
    up = tuple(range(num_blocks))
    return {
        (0, 1, 2): up,
        (2, 1, 0): up[::-1],
        "update": tuple(sorted(up, key=lambda i: f"{stem}{i}")),
    }


def _template(deep: int, num_blocks: int) -> int:
    return 0 if deep == 0 else SHALLOW_BLOCKS - 1 if deep == num_blocks - 1 else 1


def _groups(block_of: Sequence[int | None], phases: Sequence[str], what: str):
    """Items as a list of ('one', index range) and ('group', [run per shallow block in
    order], phase) entries; ValueError where the blocks' runs do not form groups of three."""
    out: list = []
    runs = _runs([(b, phases[s] if phases else "") for b, s in zip(block_of, range(len(block_of)))])
    i = 0
    while i < len(runs):
        s, e = runs[i]
        if block_of[s] is None:
            out.append(("one", (s, e)))
            i += 1
            continue
        group = runs[i : i + SHALLOW_BLOCKS]
        order = tuple(block_of[gs] for gs, _ in group)
        if len(group) < SHALLOW_BLOCKS or sorted(order) != list(range(SHALLOW_BLOCKS)):
            raise ValueError(f"the {what} of the three blocks do not follow one another")
        by_block = {block_of[gs]: (gs, ge) for gs, ge in group}
        lengths = {ge - gs for gs, ge in group}
        if len(lengths) != 1:
            raise ValueError(f"the three blocks' {what} differ in length")
        out.append(("group", order, by_block))
        i += SHALLOW_BLOCKS
    return out


def repeat_blocks(records: TraceRecords, num_blocks: int) -> TraceRecords:
    """The records of the same step with ``num_blocks`` blocks (see the module docstring)."""
    if num_blocks < SHALLOW_BLOCKS:
        raise ValueError(f"repeat_blocks makes >= {SHALLOW_BLOCKS} blocks, not {num_blocks}")
    stem, blocks = _block_names(records.layers)
    block_index = {name: i for i, name in enumerate(blocks)}
    first, last = records.layers[0], records.layers[-1]
    eqns, tensors = records.eqns, records.tensors
    n_in = len(records.inputs)
    if tuple(records.inputs) != tuple(range(n_in)):
        raise ValueError("program inputs are not the first tensor ids")
    orders = _deep_orders(num_blocks, stem)

    # where each tensor was made: an input, or with equation j (its outputs, and the
    # literals and constants made just before them)
    anchor: list[int] = [-1] * len(tensors)
    made = n_in
    for j, e in enumerate(eqns):
        if not e.outputs:
            raise ValueError(f"equation {j} ({e.primitive}) has no outputs")
        if min(e.outputs) < made or list(e.outputs) != list(
            range(min(e.outputs), min(e.outputs) + len(e.outputs))
        ):
            raise ValueError("tensor ids are not in the tracer's order")
        for t in range(made, max(e.outputs) + 1):
            anchor[t] = j
        made = max(e.outputs) + 1
    tail = list(range(made, len(tensors)))  # made after the last equation
    if any(tensors[t].kind not in ("literal", "const") for t in tail):
        raise ValueError("tensors made after the last equation are not literals")

    eqn_block = [block_index.get(e.layer) for e in eqns]
    phases = [e.phase for e in eqns]
    eqn_groups = _groups(eqn_block, phases, "equation runs")
    in_block = [_path_block(tensors[t].path, stem) for t in records.inputs]
    in_groups = _groups(in_block, [], "inputs")

    # position of every shallow equation: (group number, offset in its run)
    where: dict[int, tuple[int, int]] = {}
    for g, item in enumerate(eqn_groups):
        if item[0] == "group":
            for s, e in item[2].values():
                for j in range(s, e):
                    where[j] = (g, j - s)
        else:
            s, e = item[1]
            for j in range(s, e):
                where[j] = (g, j - s)
    for item in eqn_groups:
        if item[0] == "group":  # the three runs: the same primitives
            runs = [eqns[s:e] for s, e in item[2].values()]
            if any([x.primitive for x in r] != [x.primitive for x in runs[0]] for r in runs[1:]):
                raise ValueError("the three blocks' equation runs differ")

    new_tensors: list[TensorRecord] = []
    in_map: dict[tuple[int | None, int], int] = {}  # (deep block or None, shallow id) -> id

    def add(rec: TensorRecord, path: str | None = None) -> int:
        tid = len(new_tensors)
        new_tensors.append(
            dataclasses.replace(rec, id=tid, path=rec.path if path is None else path)
        )
        return tid

    deep_inputs: list[int] = []
    for item in in_groups:
        if item[0] == "one":
            s, e = item[1]
            for t in range(s, e):
                in_map[None, t] = add(tensors[t])
                deep_inputs.append(in_map[None, t])
            continue
        order, by_block = item[1], item[2]
        for d in orders["update"] if order == (0, 1, 2) else orders[order]:
            s, e = by_block[_template(d, num_blocks)]
            for t in range(s, e):
                in_map[d, t] = add(tensors[t], _rename_path(tensors[t].path, stem, d))
                deep_inputs.append(in_map[d, t])
    if order_check := [item[1] for item in in_groups if item[0] == "group"]:
        if any(o != (0, 1, 2) for o in order_check):
            raise ValueError("block inputs are not in pytree order")

    made_by: dict[tuple[int, int | None, int], list[int]] = {}  # (group, deep, offset)
    new_eqns: list[EqnRecord] = []

    def resolve(t: int, deep: int | None, tmpl: int | None) -> int:
        """The deep id of shallow tensor ``t`` read by deep block ``deep`` (None: outside
        the blocks) that repeats shallow block ``tmpl``."""
        if t < n_in:
            b = in_block[t]
            if b is None:
                return in_map[None, t]
            d = _deep_of(b, deep, tmpl)
            return in_map[d, _shallow_input(t, b, d)]
        j = anchor[t]
        if j < 0:
            raise ValueError(f"tensor {t} has no maker")
        b = eqn_block[j]
        g, off = where[j]
        ids = made_by[(g, None if b is None else _deep_of(b, deep, tmpl), off)]
        return ids[_made_index[t]]

    def _deep_of(b: int, deep: int | None, tmpl: int | None) -> int:
        if deep is None:  # read from outside the blocks: the first or the last block only
            if b == 0:
                return 0
            if b == SHALLOW_BLOCKS - 1:
                return num_blocks - 1
            raise ValueError("a layer outside the blocks reads a middle block")
        d = deep + b - tmpl
        if abs(b - tmpl) > 1 or not 0 <= d < num_blocks:
            raise ValueError("a block reads from a block that is not its neighbour")
        return d

    # inputs of a shallow block b as read by deep block d: the same offset in d's run
    in_offset: dict[int, tuple[int, int]] = {}
    for item in in_groups:
        if item[0] == "group":
            for s, e in item[2].values():
                for t in range(s, e):
                    in_offset[t] = (item[2], t - s)

    def _shallow_input(t: int, b: int, d: int) -> int:
        by_block, off = in_offset[t]
        s, _ = by_block[_template(d, num_blocks)]
        return s + off

    _made_index: dict[int, int] = {}
    per_eqn: dict[int, list[int]] = {}
    for t in range(n_in, made):
        per_eqn.setdefault(anchor[t], []).append(t)
    for ts in per_eqn.values():
        for k, t in enumerate(ts):
            _made_index[t] = k

    def replay(j: int, g: int, deep: int | None, tmpl: int | None) -> None:
        e = eqns[j]
        ids = []
        for t in per_eqn[j]:
            rec = tensors[t]
            ids.append(add(rec))
        made_by[(g, deep, where[j][1])] = ids
        inputs = tuple(resolve(t, deep, tmpl) for t in e.inputs)
        outputs = tuple(ids[_made_index[t]] for t in e.outputs)
        layer, module_path = e.layer, e.module_path
        if deep is not None:
            layer = f"{stem}{deep}"
            module_path = _rename_module(module_path, stem, deep)
        new_eqns.append(
            dataclasses.replace(
                e, index=len(new_eqns), inputs=inputs, outputs=outputs, layer=layer,
                module_path=module_path,
            )
        )  # fmt: skip

    for g, item in enumerate(eqn_groups):
        if item[0] == "one":
            s, e = item[1]
            for j in range(s, e):
                replay(j, g, None, None)
            continue
        order, by_block = item[1], item[2]
        deep_order = orders["update"] if phases[by_block[0][0]] == "update" else orders[order]
        if phases[by_block[0][0]] == "update" and order != (0, 1, 2):
            raise ValueError("an update pass does not run over the blocks in pytree order")
        for d in deep_order:
            tmpl = _template(d, num_blocks)
            s, e = by_block[tmpl]
            for j in range(s, e):
                replay(j, g, d, tmpl)
    for t in tail:
        add(tensors[t])

    deep_outputs: list[int] = []
    out_block = [_path_block(tensors[t].path, stem) for t in records.outputs]
    out_groups = _groups(out_block, [], "outputs")
    renamed: dict[int, str] = {}
    for item in out_groups:
        if item[0] == "one":
            s, e = item[1]
            for k in range(s, e):
                deep_outputs.append(resolve(records.outputs[k], None, None))
            continue
        if item[1] != (0, 1, 2):
            raise ValueError("block outputs are not in pytree order")
        for d in orders["update"]:
            tmpl = _template(d, num_blocks)
            s, e = item[2][tmpl]
            for k in range(s, e):
                t = records.outputs[k]
                tid = resolve(t, d, tmpl)
                deep_outputs.append(tid)
                if tensors[t].path and tid >= len(deep_inputs):
                    renamed[tid] = _rename_path(tensors[t].path, stem, d)
    for tid, path in renamed.items():
        new_tensors[tid] = dataclasses.replace(new_tensors[tid], path=path)

    pos_in = {t: k for k, t in enumerate(records.inputs)}
    pos_out = {t: k for k, t in enumerate(records.outputs)}
    alias_of = {}
    for a, o in records.aliases:
        alias_of[pos_in[a]] = pos_out[o]
    # aliases pair input and output leaves by position; the deep lists keep the pairing
    deep_aliases = []
    shallow_in_pos = _positions(in_groups, num_blocks, orders)
    shallow_out_pos = _positions(out_groups, num_blocks, orders)
    out_at = {key: k for k, key in enumerate(shallow_out_pos)}
    for k, key in enumerate(shallow_in_pos):
        shallow_k, d = key
        if shallow_k in alias_of:
            deep_aliases.append((deep_inputs[k], deep_outputs[out_at[(alias_of[shallow_k], d)]]))
    layers = (first, *(f"{stem}{i}" for i in range(num_blocks)), last)
    return TraceRecords(
        tuple(new_tensors), tuple(new_eqns), tuple(deep_inputs), tuple(deep_outputs),
        tuple(deep_aliases), layers,
    )  # fmt: skip


def _positions(groups, num_blocks: int, orders) -> list[tuple[int, int | None]]:
    """The deep list's items as (shallow position, deep block or None), in deep order."""
    out: list[tuple[int, int | None]] = []
    for item in groups:
        if item[0] == "one":
            s, e = item[1]
            out.extend((k, None) for k in range(s, e))
            continue
        for d in orders["update"]:
            s, e = item[2][_template(d, num_blocks)]
            out.extend((k, d) for k in range(s, e))
    return out
