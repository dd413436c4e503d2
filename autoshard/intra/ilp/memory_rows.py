"""The memory rows of a reduced program (jax-free): every live set in variable space.

Node memory under fixed or eliminated strategies becomes a constant, duplicate and
dominated rows go, and copy buffers (:class:`CopyBuffer`) add one window term per copy
window that the fixed strategies leave undecided.
"""

from __future__ import annotations

import itertools

import numpy as np

from autoshard.intra.ilp.reduced import _Reduced


def _indicator(red: _Reduced, v: int, strategies) -> bool | np.ndarray:
    """ "Node v picks one of ``strategies``" in variable space: a constant, or the columns
    whose sum is that 0/1 indicator."""
    b = int(red.block_of[v])
    hit = np.isin(red.maps[v], np.asarray(strategies, dtype=int))
    if red.fixed[b] >= 0:
        return bool(hit[red.fixed[b]])
    cols = red.cols[b]
    if not cols.size:
        raise RuntimeError(f"internal error: node {v}, which a copy reads, was eliminated")
    sel = np.flatnonzero(hit[cols])
    if sel.size in (0, cols.size):
        return bool(sel.size)
    return red.offset[b] + sel


def _copy_windows(red: _Reduced, constant: np.ndarray) -> dict[int, dict[int, float]]:
    """The copies' terms of the memory rows: live set -> {window: bytes}; windows whose
    liveness the fixed strategies already decide go to ``constant`` (or nowhere).

    Sets ``red.windows``: per window (copy, source indicator or True, the copy's reader
    indicators, last reader index <= a that is not constant or None when the prefix
    condition holds anyway, first index >= b likewise, the readers whose reading keeps an
    early copy's window dead: :attr:`CopyBuffer.early_unless`)."""
    red.windows, red.num_strategy_cols = [], int(sum(c.size for c in red.cols))
    out: dict[int, dict[int, float]] = {}
    index: dict[tuple, int] = {}
    for ci, copy in enumerate(red.problem.copies):
        exists = _indicator(red, copy.source, copy.source_strategies)
        if exists is False or not copy.bytes:
            continue
        reads = [_indicator(red, v, qs) for v, qs in copy.readers]
        variable = [j for j, r in enumerate(reads) if r is not True and r is not False]
        for i, a, b in copy.windows:
            blk: tuple[int, ...] = ()
            if copy.early_unless is not None:  # live unless one of its blockers reads
                blockers = copy.blockers(a)
                if any(reads[j] is True for j in blockers):
                    continue
                blk, pre = tuple(j for j in blockers if reads[j] is not False), None
            elif a < 0 or any(r is True for r in reads[: a + 1]):
                pre = None
            else:
                before = [j for j in variable if j <= a]
                if not before:
                    continue
                pre = before[-1]
            if any(r is True for r in reads[b:]):
                suf = None
            else:
                after = [j for j in variable if j >= b]
                if not after:
                    continue
                suf = after[0]
            if exists is True and pre is None and suf is None and not blk:
                constant[i] += copy.bytes
                continue
            key = (ci, pre, suf, blk)
            if key not in index:
                index[key] = len(red.windows)
                red.windows.append((ci, exists, reads, pre, suf, blk))
            wid = index[key]
            row = out.setdefault(i, {})
            row[wid] = row.get(wid, 0.0) + copy.bytes
    return out


def _memory_rows(red: _Reduced) -> list[tuple[float, np.ndarray, np.ndarray]]:
    """Live sets in variable space as (constant, columns, coefficients >= 0), without
    duplicates or rows dominated coefficient-wise by another row.

    Vectorised over all (live set, node, block strategy) triples: a block's memory under
    its fixed strategy, and the minimum over its allowed strategies, go to the constant
    (exact, since exactly one strategy per block is chosen)."""
    pb, k = red.problem, red.problem.num_strategies
    block_k = np.array([k[r] for r in red.blocks])
    slot_base = np.r_[0, np.cumsum(block_k)]
    num_slots = int(slot_base[-1])
    node_vec = [
        np.where(m >= 0, np.asarray(pb.node_memory[v])[np.maximum(m, 0)], 0.0)
        for v, m in enumerate(red.maps)
    ]
    node_val_start = np.r_[0, np.cumsum([len(x) for x in node_vec])][:-1]
    node_val = np.concatenate(node_vec)
    nodes = np.fromiter(itertools.chain.from_iterable(pb.live_sets), dtype=np.int64)
    set_id = np.repeat(np.arange(len(pb.live_sets)), [len(s) for s in pb.live_sets])
    reps = block_k[red.block_of[nodes]]
    within = np.arange(int(reps.sum())) - np.repeat(np.cumsum(reps) - reps, reps)
    slot = np.repeat(slot_base[red.block_of[nodes]], reps) + within
    value = node_val[np.repeat(node_val_start[nodes], reps) + within]
    key, inverse = np.unique(np.repeat(set_id, reps) * num_slots + slot, return_inverse=True)
    value = np.bincount(inverse, weights=value)  # duplicates (a node listed twice) add up
    row, slot = key // num_slots, key % num_slots
    # per slot: its block, and its variable column (-1 if fixed or forbidden)
    slot_block = np.repeat(np.arange(len(red.blocks)), block_k)
    slot_col = np.full(num_slots, -1)
    fixed_slot = np.zeros(num_slots, bool)
    for b, cols in enumerate(red.cols):
        slot_col[slot_base[b] + cols] = red.offset[b] + np.arange(cols.size)
        if red.fixed[b] >= 0:
            fixed_slot[slot_base[b] + red.fixed[b]] = True
    for b, c, _ in red.eliminated:  # its memory is the same under every allowed strategy
        fixed_slot[slot_base[b] + int(np.argmin(c))] = True
    num_sets = len(pb.live_sets)
    is_fixed = fixed_slot[slot]
    constant = np.bincount(row[is_fixed], value[is_fixed], minlength=num_sets).astype(float)
    free = slot_col[slot] >= 0
    row, slot, value = row[free], slot[free], value[free]
    group = row * len(red.blocks) + slot_block[slot]  # sorted, so each (set, block) is a run
    starts = np.flatnonzero(np.r_[True, np.diff(group) != 0]) if group.size else group
    low = np.minimum.reduceat(value, starts) if group.size else value
    constant += np.bincount(row[starts], weights=low, minlength=num_sets)
    coef = value - np.repeat(low, np.diff(np.r_[starts, value.size]))
    keep = coef > 0
    row, col, coef = row[keep], slot_col[slot[keep]], coef[keep]
    bounds = np.searchsorted(row, np.arange(num_sets + 1))
    extra = _copy_windows(red, constant)  # window columns follow the strategy columns
    rows: dict[tuple, tuple[float, np.ndarray, np.ndarray]] = {}
    for i in range(num_sets):
        c, w = col[bounds[i] : bounds[i + 1]], coef[bounds[i] : bounds[i + 1]]
        if i in extra:
            wids, sizes = zip(*sorted(extra[i].items()), strict=True)
            c = np.r_[c, red.num_strategy_cols + np.asarray(wids)]
            w = np.r_[w, np.asarray(sizes, dtype=float)]
        rows.setdefault((float(constant[i]), c.tobytes(), w.tobytes()), (float(constant[i]), c, w))
    unique = list(rows.values())
    by_col: dict[int, list[int]] = {}
    for i, (_, c, _) in enumerate(unique):
        for col in c.tolist():
            by_col.setdefault(col, []).append(i)
    kept = []
    for i, (const_i, c_i, w_i) in enumerate(unique):
        cands = (
            by_col[min(c_i.tolist(), key=lambda x: len(by_col[x]))]
            if c_i.size
            else range(len(unique))
        )
        dominated = False
        for j in cands:  # j dominates i: const_j >= const_i and w_j >= w_i on i's columns
            const_j, c_j, w_j = unique[j]
            if j == i or const_j < const_i:
                continue
            pos = np.searchsorted(c_j, c_i)
            if not c_i.size or (
                pos[-1] < c_j.size and np.array_equal(c_j[pos], c_i) and np.all(w_j[pos] >= w_i)
            ):
                dominated = True
                break
        if not dominated:
            kept.append(unique[i])
    return kept
