"""What tests, benchmarks and the CPU default build instead of downloading: tiny random
backbones, the trained stand-in backbone and synthetic fit sets.

Imports: every layer below it. No library layer imports it; only the commands do
(:mod:`admm_dist.cli.train` reads the test-only fault plan of :mod:`~tests.faults`).
"""
