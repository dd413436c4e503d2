"""Predicted against compiled: what XLA compiled, read back and set beside a plan.

hlo (HLO text) -> replica_groups (groups as mesh axes) -> index_eval, xla_cpu (XLA:CPU's
habits undone) -> collectives (every compiled collective, raw and normalised) -> compare
(predicted vs compiled); memory (allocation and live peak); check (the report).
"""
