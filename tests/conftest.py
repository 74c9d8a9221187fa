"""Shared test settings: gloo on loopback, one thread per process, deterministic seeds."""
import os

import pytest
import torch

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """``tiny_assets(n_agents)``: a tiny random Qwen3 backbone (built offline) and a synthetic
    DPO fit set of 16 examples per seat, built once per chain length."""
    made = {}

    def build(n_agents: int) -> dict:
        if n_agents not in made:
            from transformers import AutoTokenizer

            from admm_dist.testing.synthetic import write_fitset
            from admm_dist.testing.tiny import save_tiny_backbone

            d = tmp_path_factory.mktemp(f"tiny{n_agents}")
            bb = save_tiny_backbone(str(d / "backbone"), seed=1, hidden=32, layers=2, heads=2)
            settings = {"task": "synthetic", "n_agents": n_agents, "adapt_roles": "all"}
            fit = write_fitset(str(d / "dpo.jsonl"), settings=settings, per_seat=16,
                               tokenizer=AutoTokenizer.from_pretrained(bb))
            made[n_agents] = {"backbone": bb, "fit": fit, "settings": settings}
        return made[n_agents]
    return build
