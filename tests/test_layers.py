"""Operator clustering into layers, against brute force and on obvious cases."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoshard.inter.clustering import cluster_layers, crossing_bytes


def _cut_cost(bounds, cuts):
    inner = [cuts[b - 1] for b in bounds[1:-1]]
    return (max(inner, default=0.0), float(sum(inner)))


def brute_force(flops, cuts, num_layers, delta):
    """(FLOP cap used, best (max cut, total cut)) by enumerating every partition."""
    n = len(flops)
    parts = []
    for inner in itertools.combinations(range(1, n), num_layers - 1):
        bounds = (0, *inner, n)
        parts.append(
            (bounds, max(sum(flops[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)))
        )
    cap = (1.0 + delta) * sum(flops) / num_layers
    least = min(largest for _, largest in parts)
    if least > cap:
        cap = least
    return cap, min(_cut_cost(b, cuts) for b, largest in parts if largest <= cap)


@settings(max_examples=150, deadline=None)
@given(
    flops=st.lists(st.one_of(st.just(0.0), st.integers(1, 20).map(float)), min_size=1, max_size=9),
    data=st.data(),
    delta=st.sampled_from([0.0, 0.1, 0.25, 1.0]),
)
def test_clustering_matches_brute_force(flops, data, delta):
    n = len(flops)
    num_layers = data.draw(st.integers(1, n))
    cuts = data.draw(st.lists(st.integers(0, 10).map(float), min_size=n - 1, max_size=n - 1))
    result = cluster_layers(flops, cuts, num_layers, delta)
    cap, best = brute_force(flops, cuts, num_layers, delta)

    bounds = result.boundaries
    assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == num_layers + 1
    assert all(a < b for a, b in zip(bounds, bounds[1:], strict=False))
    assert result.layer_flops == tuple(sum(flops[a:b]) for a, b in result.ranges)
    assert result.flops_cap == pytest.approx(cap)
    assert max(result.layer_flops) <= result.flops_cap
    assert (result.max_cut_bytes, result.total_cut_bytes) == best
    assert _cut_cost(bounds, cuts) == best
    assert result.relaxed == (cap > (1.0 + delta) * sum(flops) / num_layers)
    assert len(result.layer_of_op()) == n


@pytest.mark.parametrize("ops_per_layer,num_layers", [(1, 4), (3, 4), (5, 7), (16, 3)])
def test_equal_operators_give_equal_layers(ops_per_layer, num_layers):
    n = ops_per_layer * num_layers
    rng = np.random.default_rng(n)
    result = cluster_layers([2.0] * n, rng.uniform(0, 100, n - 1), num_layers, delta=0.0)
    assert [b - a for a, b in result.ranges] == [ops_per_layer] * num_layers
    assert not result.relaxed


def test_picks_the_cheapest_balanced_cut():
    flops = [1.0] * 8
    cuts = np.array([1.0, 0.5, 9.0, 7.0, 8.0, 6.0, 0.1])  # cut c sits after operator c
    result = cluster_layers(flops, cuts, 2, delta=0.25)
    # balanced: each half holds at most 5 of the 8 ops, so the cut follows op 2, 3 or 4
    allowed = [c for c in range(len(cuts)) if max(c + 1, 8 - c - 1) <= 5]
    best = min(allowed, key=lambda c: cuts[c])
    assert result.boundaries == (0, best + 1, 8)
    assert result.max_cut_bytes == cuts[best]
    # with no balance requirement beyond "fits somewhere", the cheapest cut overall wins
    loose = cluster_layers(flops, cuts, 2, delta=10.0)
    assert loose.max_cut_bytes == cuts.min()


def test_relaxes_the_cap_when_one_operator_is_too_big():
    flops = [1.0, 1.0, 30.0, 1.0, 1.0, 1.0]
    result = cluster_layers(flops, [1.0] * 5, 3, delta=0.25)
    assert result.relaxed
    assert result.flops_cap == max(result.layer_flops) == 30.0
    assert result.delta > 0.25


def test_crossing_bytes_counts_live_ranges():
    rng = np.random.default_rng(0)
    n = 12
    tensors = []
    for _ in range(30):
        a = int(rng.integers(0, n))
        tensors.append((a, int(rng.integers(a, n)), float(rng.integers(1, 100))))
    got = crossing_bytes(n, tensors)
    naive = [sum(size for a, b, size in tensors if a <= c < b) for c in range(n - 1)]
    assert got.tolist() == naive
    with pytest.raises(ValueError, match="outside"):
        crossing_bytes(n, [(3, 1, 5.0)])


def test_large_input_is_balanced():
    rng = np.random.default_rng(1)
    flops = rng.uniform(0.0, 10.0, 2000)
    result = cluster_layers(flops, rng.uniform(0.0, 1.0, 1999), 24)
    assert not result.relaxed
    assert max(result.layer_flops) <= 1.25 * flops.sum() / 24
    assert sum(result.layer_flops) == pytest.approx(flops.sum())


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="non-empty layers"):
        cluster_layers([1.0, 2.0], [0.0], 3)
    with pytest.raises(ValueError, match="one cut_bytes entry per cut"):
        cluster_layers([1.0, 2.0, 3.0], [0.0], 2)
    with pytest.raises(ValueError, match="non-negative"):
        cluster_layers([1.0, -2.0], [0.0], 1)
