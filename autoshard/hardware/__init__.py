"""Hardware: cluster presets, GEMM efficiency tables, which mesh a plan is priced on (no jax)."""
