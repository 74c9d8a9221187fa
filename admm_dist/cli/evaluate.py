"""``python -m admm_dist.evaluate`` / ``admm-dist-evaluate``: the evaluation command's arguments.

What it does is :mod:`admm_dist.mas.evaluation` (its docstring is this command's help).
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from admm_dist.cli.common import OneLineParser, run_cli
from admm_dist.core.config_file import default_of
from admm_dist.mas import evaluation
from admm_dist.mas.chain import ChainConfig
from admm_dist.mas.prompts import prompt_modes
from admm_dist.mas.seats import GENERATION_BACKENDS, ROLE_SETS

PROG = "admm-dist-evaluate"
__doc__ = evaluation.__doc__


def build_parser() -> OneLineParser:
    p = OneLineParser(prog=PROG, description=evaluation.__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--task", required=True, help="task name (admm_dist.tasks)")
    a("--task_path", default=None, help="local JSON/JSONL/CSV file of the task's rows")
    a("--split", default=None, help="task split (default: the task's evaluation split)")
    a("--model_name", default=None, help="backbone folder or hub id (default: the training run's)")
    a("--seed", type=int, default=42, help="pool shuffle and sampling seed")
    a("--n", type=int, default=None, help="number of rows (default: all)")
    a("--offset", type=int, default=0, help="first row")
    a("--n_agents", type=int, default=default_of(ChainConfig, "n_agents"))
    a("--prompt", choices=prompt_modes(), default=default_of(ChainConfig, "prompt"))
    a("--think", action="store_true", help="enable the chat template's thinking mode")
    a("--text_mas_context_length", type=int, default=None, help="cap carried context (tokens)")
    a("--adapt_roles", choices=ROLE_SETS, default=None,
      help="seats that carry the adapter (default: the training run's, else all)")
    a("--max_new_tokens", type=int, default=default_of(ChainConfig, "max_new_tokens"))
    a("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples")
    a("--top_p", type=float, default=default_of(ChainConfig, "top_p"))
    a("--samples", type=int, default=1, help="chains per row (needs --temperature > 0 for > 1)")
    a("--batch_size", type=int, default=default_of(ChainConfig, "batch_size"))
    a("--generation_backend", choices=GENERATION_BACKENDS, default="hf",
      help="hf: transformers generate (seeded per row, bit-for-bit); vllm: a vLLM engine (docs/vllm.md)")
    a("--adapter", default=None, help="a saved B vector (<out>-last/-best.safetensors)")
    a("--deploy", choices=("consensus", "local"), default="consensus")
    a("--state", default=None, help="a training run's <out> folder (node-<i>.safetensors, seat_map.json)")
    a("--agent_models", default=None, metavar="SEAT=PATH[,SEAT=PATH]",
      help="run these seats on other backbones")
    a("--judge", default=None, help="judge model for safety tasks (folder or hub id)")
    a("--train_report", default=None, help="training report whose anchor_keys must not be evaluated")
    a("--save_trajectories", default=None, metavar="FILE.jsonl")
    a("--json", default=None, metavar="FILE", help="write the summary here")
    a("--device", choices=("auto", "cpu", "cuda"), default="auto")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli(PROG, evaluation.evaluate, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
