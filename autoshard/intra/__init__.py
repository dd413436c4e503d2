"""Intra-operator planning (no jax), in rooms: ``rules`` (sharding strategies per
primitive), ``cost`` (collectives and resharding priced), ``memory`` (the memory model and
its copy rules), ``ilp`` (the integer program and its solvers), ``problem`` (graph + mesh
-> ILP -> plan), ``offload`` (state in host memory) and ``baselines`` (hand-written plans)."""
