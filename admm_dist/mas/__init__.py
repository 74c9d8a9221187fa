"""The multi-agent system: seats, prompts, seeded batched generation, the chain runtime, and what
runs the chain (collection of fit sets, evaluation, the safety judge, the vLLM backend).

Imports: :mod:`admm_dist.core`, :mod:`admm_dist.engine`, :mod:`admm_dist.model`,
:mod:`admm_dist.tasks` and :mod:`admm_dist.data`.
"""
from admm_dist.mas.chain import ChainConfig, ChainRunner, Rollout, row_seed
from admm_dist.mas.prompts import ROLES, prompt_modes, role_name

__all__ = ["ChainConfig", "ChainRunner", "Rollout", "row_seed", "ROLES", "prompt_modes", "role_name"]
