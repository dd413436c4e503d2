"""Offload (jax-free): training state in host memory instead of HBM.

:mod:`~autoshard.intra.offload.placement`: which tensors a placement moves to the host and
what it costs; :mod:`~autoshard.intra.offload.search`: planning with a placement, or
``auto``, the cheapest placement that fits.
"""
