"""Predicted against compiled: HLO reading, XLA:CPU normalisation, live ranges, the report."""
