"""Running a plan: the sharded step and the pipeline trainer (jax)."""
