"""Shared reads: the per-demand program's share nodes (off by default,
:data:`autoshard.intra.problem.value_edges.SHARED_READS`).

Per demand, a value that several readers want in one spec pays one move per reader, where
XLA makes it once. With shared reads, every use but the value's first is priced through a
*share node*: its states are (own, b), the move into the spec b the use wants, priced as
per demand, and (shared, b), free, allowed only where the first use wants b too. Still an
upper bound on the predicted cost (a shared spec is made once; any other is paid per
reader, as before), exact where every reader wants one spec. On wresnet-tiny (8 layers)
2x4 the per-demand program charged the exact program's best plan 40,497 against its
per-value price 26,958 -- each activation gathered once for the forward conv, the
weight-gradient conv and the projection's pair, charged up to four times -- and with
share nodes its optimum is that plan, but the solve took 247-301 s against 8 s
(docs/sharing.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

INF = math.inf


@dataclass(frozen=True)
class SharedRead:
    """The share node of a use priced per demand: its states are (own, b) for each spec b
    in ``own`` and then (shared, b) for each b in ``both``; ``lead``: the value's first
    use (a :class:`~autoshard.intra.problem.value_edges.Use`), whose move a shared state
    reuses."""

    node: int
    lead: object
    use: object
    own: tuple
    both: tuple

    def state(self, wanted, lead_wants) -> int:
        """The state the node takes where the use wants ``wanted`` and the first use
        ``lead_wants``: shared wherever the two are the same spec."""
        if wanted is not None and wanted == lead_wants:
            return len(self.own) + self.both.index(wanted)
        return self.own.index(wanted)


def share_matrices(wants: tuple, lead: tuple, matrix: tuple):
    """A share node's states and cost matrices for a use wanting ``wants`` (one spec per
    reader strategy) of a value whose first use wants ``lead``, its per-demand move prices
    ``matrix`` (producer strategy x reader strategy): ``(own, both, producer's matrix,
    reader's matrix, first reader's matrix)``, each against the node's states."""
    own = tuple(dict.fromkeys(wants))
    both = tuple(b for b in own if b is not None)
    first_of = {b: wants.index(b) for b in own}
    src_m = tuple(tuple(row[first_of[b]] for b in own) + (0.0,) * len(both) for row in matrix)
    use_m = tuple(
        tuple(0.0 if x == b else INF for b in own) + tuple(0.0 if x == b else INF for b in both)
        for x in wants
    )
    lead_m = tuple((0.0,) * len(own) + tuple(0.0 if x == b else INF for b in both) for x in lead)
    return own, both, src_m, use_m, lead_m
