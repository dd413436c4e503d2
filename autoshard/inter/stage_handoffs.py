"""The handoffs between a stage's layers, as :class:`~autoshard.inter.stage_cost.IntraStageCost`
prices them (a mixin of it): which inputs of a layer's unit a layer of its own signature
passes it (ties) or one of another signature makes (feeds) or reads (drains), the specs the
units planned first make or read them in, and the seconds per microbatch of resharding what
one layer's plan sends the next (junctions). The functions on sub-graphs are
:mod:`autoshard.inter.unit_ties`'.
"""

from __future__ import annotations

import math

from autoshard.hardware.mesh import DeviceMesh
from autoshard.inter.folding import crossing_pairs
from autoshard.inter.plan import Shape2
from autoshard.inter.subgraph import RangeGraph
from autoshard.inter.unit_cost import crossing_seconds, read_specs
from autoshard.inter.unit_ties import drains, feeds, self_ties
from autoshard.intra.cost.collectives import CostOptions

_NO_TIES = CostOptions(tie_breakers=False)


class LayerHandoffs:
    """Handoff methods of :class:`~autoshard.inter.stage_cost.IntraStageCost` (which owns
    every attribute they read: the traced graph, signatures, units, sub-graphs, memos)."""

    def _tie_pairs(self, rg: RangeGraph) -> tuple:
        """(input, output) positions of ``rg``'s unit that a layer of its own signature
        passes it (:mod:`autoshard.inter.unit_ties`); none for a range of several layers
        or a baseline's units (their inputs are pinned)."""
        if rg.end != rg.start + 1 or self.baseline is not None:
            return ()
        if self._ties is None:
            # one crossing per (producer signature, consumer signature, distance): the
            # others pass the same positions (as junction prices them), and each costs
            # two layers' sub-graphs (gpt-39b: 47 block pairs, ~1 s)
            distinct = {}
            for a, b in crossing_pairs(self.graph):
                sig = self._shallow_signatures
                distinct.setdefault((sig[a], sig[b], b - a), (a, b))
            crossings = tuple(distinct.values())
            self._ties = self_ties(
                self.graph, self._shallow_subgraph, crossings, self._shallow_signatures,
                {pair: pair for pair in crossings},
            )  # fmt: skip
            self._feeds = feeds(
                self._shallow_subgraph, crossings, self._shallow_signatures, self._ties
            )
            self._drains = drains(
                self._shallow_subgraph, crossings, self._shallow_signatures, self._ties
            )
        return self._ties.get(self._shallow_signatures[rg.start], ())

    def _linked(self, layer: int) -> bool:
        """Does layer ``layer``'s unit price a junction with a layer of another signature
        (so its plan depends on which units are planned before it)?"""
        rg = self.subgraph(layer, layer + 1)
        self._tie_pairs(rg)
        sig = self._shallow_signatures[rg.start]
        return self.baseline is None and (sig in self._feeds or sig in self._drains)

    def _handoff_units(self, layer: int, mesh: DeviceMesh) -> tuple:
        """The unit keys whose plans layer ``layer``'s unit on ``mesh`` reads (its
        producers' and its planned readers': :meth:`_fed_specs`, :meth:`_drain_reads`)."""
        rg = self.subgraph(layer, layer + 1)
        layers = [a for _, a, _ in self._rows(rg, "_feeds")]
        layers += [b for _, b, _ in self._rows(rg, "_drains")]
        return tuple(dict.fromkeys(((self._shallow_signatures[a],), mesh) for a in layers))

    def _rows(self, rg: RangeGraph, table: str) -> tuple:
        """``rg``'s unit's rows of ``table`` ("_feeds" or "_drains"); none for a range of
        several layers or a baseline's units (as :meth:`_tie_pairs`)."""
        self._tie_pairs(rg)  # builds the tables
        if rg.end != rg.start + 1 or self.baseline is not None:
            return ()
        return getattr(self, table).get(self._shallow_signatures[rg.start], ())

    def _feeders(self, rg: RangeGraph) -> tuple:
        """The signatures of the layers that make ``rg``'s unit's fed inputs."""
        rows = self._rows(rg, "_feeds")
        return tuple(dict.fromkeys(self._shallow_signatures[a] for _, a, _ in rows))

    def _fed_specs(self, rg: RangeGraph, mesh: DeviceMesh, seen=None) -> tuple:
        """((input position, spec), ...): the inputs of ``rg``'s unit that a layer of
        another signature makes, each in the spec that layer's plan on ``mesh`` makes it
        (:func:`~autoshard.inter.unit_ties.with_feeds`); a producer not planned yet (a
        cycle) leaves its input free. ``seen``: the unit keys planned before this one
        (None: every unit planned so far)."""
        made = []
        for k, a, j in self._rows(rg, "_feeds"):
            key = ((self._shallow_signatures[a],), mesh)
            producer = self._units.get(key) if seen is None or key in seen else None
            if producer is not None and producer.plan is not None:
                made.append((k, producer.plan.output_specs[j]))
        return tuple(made)

    def _drain_reads(self, rg: RangeGraph, mesh: DeviceMesh, seen=None) -> tuple:
        """((output position, specs), ...): the outputs of ``rg``'s unit that a planned
        layer of another signature reads, and the specs its plan reads each in
        (:func:`~autoshard.inter.unit_ties.with_drains`; ``seen`` as :meth:`_fed_specs`)."""
        reads = []
        for j, b, k in self._rows(rg, "_drains"):
            key = ((self._shallow_signatures[b],), mesh)
            consumer = self._units.get(key) if seen is None or key in seen else None
            if consumer is not None and consumer.plan is not None:
                gb = self._shallow_subgraph(b).graph
                reads.append((j, tuple(read_specs(gb, consumer.plan, k))))
        return tuple(reads)

    def junction(self, a: int, b: int, logical: Shape2) -> float:
        """Seconds to reshard what layer ``a``'s plan sends layer ``b``'s plan: from the
        spec ``a`` makes each crossing tensor in straight to the specs ``b``'s equations
        read it in, less the reads ``b``'s plan charged already
        (:func:`~autoshard.inter.unit_cost.crossing_seconds`)."""
        mesh = self.mesh_for(logical)
        key = (self.signatures[a], self.signatures[b], b - a, mesh)
        if key not in self._junctions:
            ua, ub = self.unit(a, a + 1, logical), self.unit(b, b + 1, logical)
            sa, sb = self._pair_rep[(a, b)]  # the shallow pair that passes these tensors
            ga, gb = self._shallow_subgraph(sa), self._shallow_subgraph(sb)
            cost = 0.0
            if ua.plan is None or ub.plan is None:
                cost = math.inf
            else:
                out_pos = {ga.tensor_ids[t]: k for k, t in enumerate(ga.graph.outputs)}
                for k, tid in enumerate(gb.graph.inputs):
                    orig = gb.tensor_ids[tid]
                    if orig in out_pos:
                        t = gb.graph.tensors[tid]
                        src = ua.plan.output_specs[out_pos[orig]]
                        held = ub.plan.input_specs[k]
                        reads = read_specs(gb.graph, ub.plan, k)
                        item = max(t.nbytes // max(t.size, 1), 1)
                        cost += crossing_seconds(src, held, reads, t.shape, item, mesh, _NO_TIES)
            self._junctions[key] = cost
        return self._junctions[key]

    def junctions_s(self, start: int, end: int, logical: Shape2) -> float:
        """Seconds per microbatch of the junctions inside layers ``[start, end)`` (0 with
        ``granularity="range"``: a range's ILP holds its own)."""
        if self.granularity != "layer":
            return 0.0
        logical = tuple(logical)
        return sum(
            self.junction(a, b, logical)
            for a, b in self._crossings
            if start <= a < end and start <= b < end
        )
