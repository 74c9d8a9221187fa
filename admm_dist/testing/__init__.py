"""What tests, benchmarks and the CPU default build instead of downloading: tiny random
backbones, the trained stand-in backbone and synthetic fit sets.

Imports: every layer below :mod:`admm_dist.cli`; the product never imports it.
"""
