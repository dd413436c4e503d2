"""Intra-operator planning: strategies, costs, the ILP problem, the memory model, the solver (no jax)."""
