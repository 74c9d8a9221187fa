"""The project's own studies, each a module run from a clone's root as ``python -m benchmarks.<name>``:
learning fidelity (``fidelity``, with ``fidelity_run`` and ``fidelity_stats``), curvature
(``curvature``), slow links (``links``), kill/resume (``kill_resume``), placement and memory
(``placement``, with ``placement_memory``) and collection (``collect``). They are not installed
with the package (``pip install`` ships ``admm_dist`` only); the benchmarks a user runs on their
own hardware are ``python -m admm_dist.bench.<name>``. Their figures are in docs/benchmarks.md.
"""
