"""Plans read for people, and taken elsewhere (jax-free): the digest of a plan file,
exports to Megatron-LM, DeepSpeed and MaxText, pictures and a self-contained HTML page."""
