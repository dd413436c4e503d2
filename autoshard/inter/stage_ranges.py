"""The stage DP's view of a stage cost: what a range of layers costs under a recompute
mode, and which ranges cost the same -- the methods of
:class:`~autoshard.inter.stage_cost.IntraStageCost` that answer the DP (a mixin of it,
which owns every attribute they read: units, crossings, owners, memos). Jax-free."""

from __future__ import annotations

import math

from autoshard.inter.plan import Shape2
from autoshard.inter.stages import RECOMPUTE_MODES, StageCost
from autoshard.inter.unit_cost import (
    UnitCost,
    activation_exposed_s,
    with_activations_offloaded,
)


class RangeCosts:
    """Range methods of :class:`~autoshard.inter.stage_cost.IntraStageCost`."""

    def range_key(self, start: int, end: int):
        """What :meth:`range_cost` of ``[start, end)`` depends on, as a small int, so that
        the stage DP costs ranges with equal keys once.  With ``granularity="layer"``: the
        key of ``[start, end - 1)`` and what layer ``end - 1`` adds -- its signature, the
        crossings it closes inside the range (by offset), the owners of the parameters it
        borrows (inside, by offset; outside, by index), the earlier layers whose borrowed
        owner it is, and whether it is the last layer (no recompute there; the first key
        says whether the range starts at layer 0).  Equal keys mean equal layers,
        crossings, borrowings and recompute, so equal costs.  With ``"range"``: the range."""
        if self.granularity != "layer":
            return (start, end)
        memo = self._range_keys
        if (start, end) in memo:
            return memo[start, end]
        if self._crossings_by_high is None:
            by_high: dict[int, list[tuple[int, int, int]]] = {}
            borrowers: dict[int, list[int]] = {}
            for a, b in self._crossings:
                by_high.setdefault(max(a, b), []).append((min(a, b), a, b))
            for layer in range(self.num_layers):
                for o in self._borrow_owners(layer):
                    borrowers.setdefault(o, []).append(layer)
            self._crossings_by_high, self._borrowers = by_high, borrowers
        last = end - 1
        closed = tuple(
            sorted(
                (a - start, b - start)
                for low, a, b in self._crossings_by_high.get(last, ())
                if low >= start
            )
        )
        owners = tuple(
            o - start if start <= o < end else ("out", o) for o in self._borrow_owners(last)
        )
        flips = tuple(x - start for x in self._borrowers.get(last, ()) if start <= x < last)
        delta = (self.signatures[last], closed, owners, flips, end == self.num_layers)
        prev = ("first", start == 0) if last == start else self.range_key(start, last)
        key = self._key_ids.setdefault((prev, delta), len(self._key_ids))
        memo[start, end] = key
        return key

    def _borrow_owners(self, layer: int) -> tuple[int, ...]:
        """The owner layers of the parameters layer ``layer``'s unit reads but does not
        update (its representative's, as :meth:`_plan_unit` records them)."""
        sig = self.signatures[layer]
        if sig not in self._owners_of:
            rg = self.subgraph(self._rep[sig], self._rep[sig] + 1)
            g = rg.graph
            aliased = {src for src, _ in g.aliases}
            self._owners_of[sig] = tuple(
                dict.fromkeys(
                    self._deep_owner(self.owners.get(rg.tensor_ids[tid], -1))
                    for tid in g.inputs
                    if g.tensors[tid].kind in ("param", "opt_state") and tid not in aliased
                )
            )
        return self._owners_of[sig]

    def recomputes(self, layer: int) -> bool:
        """Recompute applies to the inner layers (transformer blocks), not to the first
        (embedding) and last (head, loss: Megatron never recomputes the logits)."""
        return 0 < layer < self.num_layers - 1

    def _mode_terms(self, u: UnitCost, mode: str, recomputed: bool) -> tuple[float, float, float]:
        """(latency, kept activation bytes, working bytes) of one unit under ``mode``; the
        offload's seconds per step are spread over the microbatches, as the update's are,
        and its staging buffers are working bytes."""
        latency = u.compute_s + u.communication_s + u.offload_s / self.num_microbatches
        if mode == "none" or not recomputed or not math.isfinite(latency):
            terms = latency, u.activation_bytes, u.staging_bytes
            extra_s = 0.0
        else:
            working = u.activation_bytes if mode == "full" else 0.0
            extra_s = u.recompute_s[mode]
            terms = (
                latency + extra_s,
                u.kept_activation_bytes[mode],
                working + u.staging_bytes,
            )
        if self.offload.activations and math.isfinite(latency):
            return with_activations_offloaded(u, *terms, extra_s, self.cluster)
        return terms

    def activation_offload_s(self, layer: int, logical: Shape2, mode: str = "none") -> float:
        """Seconds per microbatch that layer ``layer``'s offloaded activations add to its
        latency under recompute ``mode`` (0 without ``activations`` offloaded)."""
        if not self.offload.activations:
            return 0.0
        u = self.unit(layer, layer + 1, tuple(logical))
        if not math.isfinite(u.compute_s):
            return 0.0
        recomputed = mode != "none" and self.recomputes(layer)
        kept = u.kept_activation_bytes[mode] if recomputed else u.activation_bytes
        recompute_s = u.recompute_s[mode] if recomputed else 0.0
        return activation_exposed_s(u, kept, recompute_s, self.cluster)

    def _layer_table(self, logical: Shape2, mode: str) -> tuple:
        """Per layer: (latency, owned bytes, kept activation bytes, working bytes,
        borrowed) under ``mode``; per crossing pair: junction seconds.  Built once per
        logical mesh and mode."""
        if (logical, mode) not in self._tables:
            units = [self.unit(i, i + 1, logical) for i in range(self.num_layers)]
            crossings = [(a, b, self.junction(a, b, logical)) for a, b in self._crossings]
            terms = [self._mode_terms(u, mode, self.recomputes(i)) for i, u in enumerate(units)]
            self._tables[logical, mode] = (
                [t[0] for t in terms],
                [u.owned_state_bytes for u in units],
                [t[1] for t in terms],
                [t[2] for t in terms],
                [dict(u.borrowed_param_bytes) for u in units],
                crossings,
            )
        return self._tables[logical, mode]

    def range_cost(self, start: int, end: int, logical: Shape2, mode: str = "none") -> StageCost:
        """Latency and memory of layers ``[start, end)`` on ``logical`` (one microbatch)
        with recompute ``mode`` in its inner layers (see :meth:`recomputes`)."""
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute mode must be one of {RECOMPUTE_MODES}, got {mode!r}")
        if self.granularity == "range":
            u = self.unit(start, end, logical)
            inner = any(self.recomputes(i) for i in range(start, end))
            latency, act, working = self._mode_terms(u, mode, inner)
            owned = u.owned_state_bytes
            borrowed_list = [dict(u.borrowed_param_bytes)]
        else:
            lat, own, acts, work, borrowed_list, crossings = self._layer_table(logical, mode)
            latency = sum(lat[start:end]) + sum(
                c for a, b, c in crossings if start <= a < end and start <= b < end
            )
            owned, act = sum(own[start:end]), sum(acts[start:end])
            working = max(work[start:end])
            borrowed_list = borrowed_list[start:end]
        if not math.isfinite(latency):
            return StageCost(math.inf, 0.0, 0.0)
        borrowed: dict[int, float] = {}
        for items in borrowed_list:
            for owner, size in items.items():
                if not start <= owner < end:
                    borrowed[owner] = max(borrowed.get(owner, 0.0), size)
        return StageCost(latency, owned + sum(borrowed.values()), act, working)
