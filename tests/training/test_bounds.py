"""Every setting that sizes memory or work is bounded, and a value past its bound is one UserError
line naming the limit and the fix, before anything is allocated (issue 40, items 4, 6 and 7):
the ceilings of admm_dist.core.constants at config time (batch_size's before any sampler draws);
lora_rank by the backbone's projections before PEFT builds the adapter.
Also: seed=-1 is reported as seed, a path with a control character or an outer space is refused,
and compress under local_only is refused. Real configs, the real trainer, a real tiny model."""
import dataclasses
import os

import pytest

from admm_dist.core import config_file as C
from admm_dist.core.errors import UserError
from admm_dist.training.config import TrainConfig

from conftest import REPO, train_local

RING = str(REPO / "configs" / "cpu" / "admm_ring.yaml")


def ring(tmp_path, *overrides: str) -> TrainConfig:
    """configs/cpu/admm_ring.yaml (its shipped tiny backbone and fit set) with ``overrides``."""
    return C.load(TrainConfig, ["--config", RING, f"model_name={REPO / 'assets' / 'tiny' / 'backbone'}",
                                f"fitset_cache={REPO / 'assets' / 'tiny' / 'fitset-dpo.jsonl'}",
                                f"out={tmp_path / 'run'}", f"report_dir={tmp_path / 'rep'}", "quiet=true",
                                *overrides])


def refusal(fn, *args, **kw) -> str:
    with pytest.raises(UserError) as info:
        fn(*args, **kw)
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------ ceilings, at config time
def test_n_agents_of_a_billion_is_refused_in_one_line(tmp_path):
    """It was killed by the OOM killer after 56 s (a list of every seat), with an empty stderr."""
    assert refusal(ring, tmp_path, "n_agents=1000000000") == \
        "n_agents=1000000000 exceeds the ceiling 64: use at most 64"
    assert ring(tmp_path).n_agents == 4


def test_a_chain_built_directly_has_the_same_ceiling():
    from admm_dist.mas.chain import ChainConfig
    assert refusal(ChainConfig, n_agents=65) == "n_agents=65 exceeds the ceiling 64: use at most 64"
    assert ChainConfig(n_agents=64).n_agents == 64


def test_batch_size_of_a_billion_is_refused_before_the_sampler_draws(tmp_path):
    """The sampler drew 10^9 indices for minutes: now refused with the configuration."""
    assert refusal(ring, tmp_path, "batch_size=1000000000") == \
        "batch_size=1000000000 exceeds the ceiling 4096: use at most 4096"


def test_every_setting_that_sizes_memory_or_work_has_its_ceiling():
    from admm_dist.core import constants as K
    expected = {
        "n_agents": K.MAX_AGENTS, "n_partitions": K.MAX_NODES,
        "anchors": K.MAX_QUERIES, "anchor_pool": K.MAX_QUERIES, "recollect_anchors": K.MAX_QUERIES,
        "gen_chunk": K.MAX_QUERIES, "group": K.MAX_SAMPLES, "prefix_samples": K.MAX_SAMPLES,
        "max_new_tokens": K.MAX_TOKENS, "sink_tokens": K.MAX_TOKENS, "max_prompt_tokens": K.MAX_TOKENS,
        "max_target_tokens": K.MAX_TOKENS, "vllm_max_model_len": K.MAX_TOKENS, "gen_batch_size": K.MAX_GEN_BATCH,
        "k_outer": K.MAX_ROUNDS, "dev_every": K.MAX_ROUNDS, "checkpoint_every": K.MAX_ROUNDS,
        "recollect_every": K.MAX_ROUNDS, "keep_checkpoints": K.MAX_ROUNDS, "local_steps": K.MAX_LOCAL_STEPS,
        "batch_size": K.MAX_BATCH_SIZE, "micro_batches": K.MAX_BATCH_SIZE, "gossip_steps": K.MAX_GOSSIP_STEPS,
        "timeout_s": K.MAX_TIMEOUT_S, "n_ops": K.MAX_OPS,
        "vllm_kv_cache_gib": K.MAX_KV_CACHE_GIB,
    }
    ceilings = {f.name: f.metadata.get("at_most") for f in dataclasses.fields(TrainConfig)
                if f.metadata.get("at_most") is not None}
    assert ceilings == expected
    for name, limit in ceilings.items():
        over = limit + 1 if isinstance(limit, int) else limit * 2
        shown = str(over) if isinstance(over, int) else f"{over:g}"
        at = str(limit) if isinstance(limit, int) else f"{limit:g}"
        assert refusal(C.load, TrainConfig, [f"{name}={over}"]) == \
            f"{name}={shown} exceeds the ceiling {at}: use at most {at}", name


def test_the_ceilings_are_in_the_help():
    from admm_dist.training.config import help_text
    text = " ".join(help_text().split())
    assert "--n_agents N seats in the chain" in text and "at most 64; default: 4" in text
    assert "at most 4096; default: 8" in text    # batch_size


# ------------------------------------------------------------------ lora_rank: by the backbone
@pytest.fixture(scope="module")
def backbone():
    """A tiny Qwen3 whose smallest projection is the MLP's (hidden 64, intermediate 48)."""
    from admm_dist.demo.tiny import tiny_qwen3
    return lambda layers=2: tiny_qwen3(102, hidden=64, layers=layers, heads=4, intermediate=48)


def test_lora_rank_of_a_million_is_refused_before_peft_allocates(backbone):
    """It grew to 24 GB before being killed: now refused from the module shapes, nothing built."""
    from admm_dist.model.adapter import AdapterConfig, BOnlyLoRA
    model = backbone(layers=1)
    cfg = AdapterConfig(lora_rank=1_000_000, lora_layers_last=1, lora_targets="attn_qv")
    assert refusal(BOnlyLoRA, model, cfg) == (
        "lora_rank=1000000 exceeds 64, the smallest dimension of the projections it adapts (attn_qv: q_proj, "
        "v_proj) in Qwen3ForCausalLM: use at most 64")
    assert not any("lora" in name for name, _ in model.named_modules())   # PEFT never ran


def test_lora_rank_is_bounded_by_the_projections_it_adapts(backbone):
    from admm_dist.model.adapter import AdapterConfig, BOnlyLoRA
    assert BOnlyLoRA(backbone(), AdapterConfig(lora_rank=64, lora_layers_last=2, lora_targets="attn_qv")).numel
    assert refusal(BOnlyLoRA, backbone(), AdapterConfig(lora_rank=49, lora_layers_last=2)) == (
        "lora_rank=49 exceeds 48, the smallest dimension of the projections it adapts (attn_mlp: q_proj, "
        "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) in Qwen3ForCausalLM: use at most 48")
    assert BOnlyLoRA(backbone(), AdapterConfig(lora_rank=48, lora_layers_last=2)).numel


def test_the_trainer_refuses_lora_rank_above_the_backbone_in_one_line(tmp_path):
    cfg = ring(tmp_path, "lora_rank=65", "dry_run=true")
    assert refusal(train_local, cfg) == (
        "lora_rank=65 exceeds 64, the smallest dimension of the projections it adapts (attn_mlp: q_proj, k_proj, "
        f"v_proj, o_proj, gate_proj, up_proj, down_proj) in {REPO / 'assets' / 'tiny' / 'backbone'}: "
        "use at most 64")


# ------------------------------------------------------------------ batch_size: its ceiling only
def test_a_batch_larger_than_every_node_still_trains_as_before(tmp_path):
    """batch_size is bounded by MAX_BATCH_SIZE, not by a node's examples: a node with fewer repeats
    them within a batch (an on-policy collection of a few queries gives such nodes)."""
    report = train_local(ring(tmp_path, "batch_size=25", "dry_run=true"))
    assert report["node_sizes"] == [24] * 4


# ------------------------------------------------------------------ item 6: seed=-1 names seed
@pytest.mark.parametrize("seed", [-1, 2 ** 63])
def test_a_seed_out_of_range_is_reported_as_seed(seed):
    """It was reported as lora_basis_seed=-1 (the basis seed defaults to the seed)."""
    assert refusal(C.load, TrainConfig, [f"seed={seed}"]) == (
        f"seed={seed} is invalid: use an integer in [0, 2**63) (it also seeds the LoRA basis unless "
        "lora_basis_seed is set)")
    assert refusal(C.load, TrainConfig, ["lora_basis_seed=-1"]).startswith("lora_basis_seed=-1 is invalid")


# ------------------------------------------------------------------ item 7: paths, compress
@pytest.mark.parametrize("key", ["out", "report_dir", "tracking_dir", "fitset_cache", "init_state", "task_path",
                                 "model_name"])
@pytest.mark.parametrize("value, what", [
    ("runs/x\n", "holds the control character '\\n'"),
    ("runs/\tx", "holds the control character '\\t'"),
    ("runs/x\x00", "holds the control character '\\x00'"),
    ("runs/x ", "starts or ends with a space"),
    (" runs/x", "starts or ends with a space"),
])
def test_a_path_with_a_control_character_or_an_outer_space_is_refused(key, value, what):
    assert refusal(TrainConfig, **{key: value}) == f"{key}={value!r} {what}: give the path without it"


def test_paths_with_inner_spaces_still_load():
    cfg = TrainConfig(out="runs/my run", report_dir="my results", fitset_cache="fit set.jsonl")
    assert cfg.out.endswith("runs/my run") and cfg.fitset_cache == "fit set.jsonl"


@pytest.mark.parametrize("compress", ["int8", "fp8"])
def test_compress_under_local_only_is_refused(tmp_path, compress):
    import torch
    if compress == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no fp8")
    assert refusal(ring, tmp_path, "local_only=true", f"compress={compress}") == \
        f"compress={compress} has no effect under local_only (nothing is exchanged): drop compress= or local_only"
    assert ring(tmp_path, "local_only=true").compress == "none"
    assert ring(tmp_path, f"compress={compress}").local_only is False


# ------------------------------------------------------------------ the fit set, through the command
def test_a_fit_set_line_over_its_ceiling_stops_the_command_in_one_line(tmp_path, capsys):
    """A 20 MB prompt aborted in the tokenizer (rc 134): a line over the ceiling is refused while
    the file is read, before it is parsed (here 2 MiB, the shipped fit set otherwise)."""
    import json

    from admm_dist.cli.train import main
    from admm_dist.core.constants import MAX_FITSET_LINE_BYTES
    lines = (REPO / "assets" / "tiny" / "fitset-dpo.jsonl").read_text(encoding="utf-8").splitlines()
    ex = json.loads(lines[3])
    ex["prompt"] = "x" * (2 * MAX_FITSET_LINE_BYTES)
    lines[3] = json.dumps(ex)
    fit = tmp_path / "fit.jsonl"
    fit.write_text("\n".join(lines) + "\n", encoding="utf-8")
    rc = main(["--config", RING, f"fitset_cache={fit}", f"model_name={REPO / 'assets' / 'tiny' / 'backbone'}",
               f"out={tmp_path / 'run'}", f"report_dir={tmp_path / 'rep'}", "dry_run=true", "quiet=true"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert rc == 2 and err == [
        f"admm_dist.train: error on rank 0: {fit}: line 4 is longer than {MAX_FITSET_LINE_BYTES} bytes, the ceiling "
        "of a fit-set line (MAX_FITSET_LINE_BYTES): no example is that long; the file is not one admm_dist wrote, "
        "or was edited: rebuild the fit set"]
    assert not os.path.exists(tmp_path / "run-last.safetensors")
