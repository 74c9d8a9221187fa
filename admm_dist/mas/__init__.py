"""The multi-agent system: prompt modes, seeded batched generation and the chain runtime."""
from .chain import ChainConfig, ChainRunner, Rollout, row_seed
from .prompts import ROLES, prompt_modes, role_name

__all__ = ["ChainConfig", "ChainRunner", "Rollout", "row_seed", "ROLES", "prompt_modes", "role_name"]
