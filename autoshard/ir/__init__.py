"""The artifacts passed between passes: trace records, the op graph, sharding specs, plans (no jax)."""
