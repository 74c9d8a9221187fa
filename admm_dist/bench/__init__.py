"""Benchmarks that print figures measured side by side: ``python -m admm_dist.bench.<name>``
(comm, xstep, fidelity, collect, curvature). The top layer: anything below may be imported."""
