"""Pass 1: the training step traced into flat, tagged records (the only jaxpr reader)."""
