"""A saved B vector records the backbone it was trained on (issue 21): ``load_vector(...,
backbone=True)`` refuses one of the same shape with other weights, naming both, and accepts the
same backbone whatever its dtype (fp32 on CPU, bf16 as on a GPU). Real tiny Qwen3 models, real
PEFT, real files."""
import pytest
import torch

from admm_dist.model.adapter import AdapterConfig, AdapterError, BOnlyLoRA
from admm_dist.model import vectors
from admm_dist.model.vectors import load_vector, save_vector
from admm_dist.demo.tiny import char_tokenizer, tiny_qwen3

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
CFG = AdapterConfig(lora_rank=4, lora_layers_last=2, lora_targets="attn_qv")


def adapter(seed: int, name: str, dtype=None) -> BOnlyLoRA:
    model = tiny_qwen3(len(char_tokenizer()), seed=seed)
    if dtype is not None:
        model = model.to(dtype)
    model.name_or_path = name            # what from_pretrained(name) sets
    return BOnlyLoRA(model, CFG)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    a = adapter(0, "models/base")
    a.load_vector(torch.randn(a.numel, generator=torch.Generator().manual_seed(1)))
    path = str(tmp_path_factory.mktemp("v") / "run-last.safetensors")
    save_vector(path, a.vector(), {"round": 2}, adapter=a)
    return path, a


def test_the_file_records_its_backbone(saved):
    path, a = saved
    _, meta = load_vector(path)
    assert meta["adapter"]["backbone"] == vectors.backbone_identity(a)
    assert meta["adapter"]["backbone"]["name"] == "models/base" and len(meta["adapter"]["backbone"]["weights"]) == 64


def test_another_backbone_of_the_same_shape_is_refused_naming_both(saved):
    path, a = saved
    other = adapter(7, "models/finetune")
    assert other.identity() == a.identity()          # same config, basis, layout and size: only the weights differ
    mine, theirs = vectors.backbone_identity(other)["weights"][:12], vectors.backbone_identity(a)["weights"][:12]
    with pytest.raises(AdapterError) as info:
        load_vector(path, other, backbone=True)
    assert str(info.value) == (
        f"{path} was trained on backbone models/base (weights {theirs}) but the loaded backbone is "
        f"models/finetune (weights {mine}): load it on the backbone it was trained on (--model_name models/base)")
    # the same name over other weights (a folder overwritten by another model) says so
    with pytest.raises(AdapterError, match=r"\(same name, other weights\)"):
        load_vector(path, adapter(7, "models/base"), backbone=True)
    load_vector(path, other)     # without backbone=True only the adapter's shape is checked, as before


def test_the_same_backbone_loads_in_fp32_and_in_bf16(saved):
    path, a = saved
    for dtype in (None, torch.bfloat16):
        vec, _ = load_vector(path, adapter(0, "elsewhere/base", dtype), backbone=True)   # a moved folder too
        assert torch.equal(vec, a.vector())


def test_a_file_without_a_recorded_backbone_still_loads(saved, tmp_path):
    path, a = saved
    _, meta = load_vector(path)
    del meta["adapter"]["backbone"]
    old = str(tmp_path / "old.safetensors")
    save_vector(old, a.vector(), meta)                # written as before the backbone was recorded
    vec, _ = load_vector(old, adapter(7, "models/finetune"), backbone=True)
    assert torch.equal(vec, a.vector())
