"""What tests, benchmarks and the CPU default build instead of downloading: tiny random
backbones, the trained stand-in backbone and synthetic fit sets.

Imports: every layer below it. No library layer imports it; only the commands do.
"""
