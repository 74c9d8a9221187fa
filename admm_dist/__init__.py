"""admm_dist: consensus-ADMM training of an LLM multi-agent system, one torchrun rank per seat.

Entry points: ``python -m admm_dist.train`` (the trainer), ``python -m admm_dist.lsq`` (the
engine on distributed least squares), ``python -m admm_dist.bench.comm`` and
``python -m admm_dist.bench.xstep`` (benchmarks). See README.md and DESIGN.md.
"""

__version__ = "0.1.0"
