"""The backbone sharded over a seat group (model/sharding.py): each of 2 real gloo ranks reads only
its rows of every weight, and the sharded model computes the whole model's bits (logits,
B gradients), digest and norms; reference log-probs split over the group are the single
rank's; the weight reader refuses a cut file, a dtype it cannot read and a hostile header."""
import json
import os
import shutil
import struct

import pytest
import torch
import torch.distributed as dist

from admm_dist.core.errors import UserError
from admm_dist.data.fitset import Example
from admm_dist.engine.launcher import launch_cpu
from admm_dist.engine.seat_group import SeatGroup
from admm_dist.model import batches as bt
from admm_dist.model import objectives as obj
from admm_dist.model.adapter import AdapterConfig, BOnlyLoRA
from admm_dist.model.loading import load_model
from admm_dist.model.sharding import WeightFiles, held_bytes, whole
from admm_dist.testing.tiny import save_tiny_backbone


def _examples(tok, n=11):
    rows = [Example(seat=0, role="Solver", anchor=f"q{i}", prompt=f"Q:{i}" + "x" * (i % 3),
                    target="yes" + "!" * (i % 2), rejected="no" + "." * (i % 3)) for i in range(n)]
    return bt.encode(tok, rows, obj.ObjectiveConfig())


def _check_sharded(ctx, folder):
    cpu = torch.device("cpu")
    group = dist.group.WORLD
    sharded, tok = load_model(folder, cpu, shard_over=group)
    plain, _ = load_model(folder, cpu)
    full = dict(plain.named_parameters())
    rank = dist.get_rank()
    for name, p in sharded.named_parameters():      # this rank's rows of every weight, read from the file
        local, want = p.to_local(), full[name]
        chunk = -(-want.shape[0] // 2)
        assert torch.equal(local, want[rank * chunk:rank * chunk + local.shape[0]]), name
    cfg = AdapterConfig(lora_rank=4, lora_alpha=8.0, lora_layers_last=2)
    a, b = BOnlyLoRA(sharded, cfg), BOnlyLoRA(plain, cfg)
    assert a.backbone_id == b.backbone_id and a.base_sq == b.base_sq
    held, lora = held_bytes(a.model)
    whole_bytes, whole_lora = held_bytes(b.model)
    assert lora == whole_lora and 0.45 * whole_bytes <= held <= 0.55 * whole_bytes, (held, whole_bytes)
    with torch.no_grad():
        vec = torch.randn(a.numel, generator=torch.Generator().manual_seed(5)) * 0.05
    enc = _examples(tok)
    for adapter in (a, b):
        adapter.load_vector(vec)
        adapter.zero_grad()
        obj.token_logps(adapter.model, bt.collate(enc[:4], tok.pad_token_id)).sum().backward()
    assert torch.equal(a.flat_grad, b.flat_grad)
    # reference log-probs: 11 examples in batches of 4 (3 batches: rank 1 repeats the last)
    split, one = _examples(tok), _examples(tok)
    seat = SeatGroup(2, rank, group, leader=0)
    obj.precompute_reference(a.model, split, batch_size=4, ref_context=a.disabled, pad_id=tok.pad_token_id,
                             part=(rank, 2), gather=seat.gather)
    obj.precompute_reference(b.model, one, batch_size=4, ref_context=b.disabled, pad_id=tok.pad_token_id)
    for x, y in zip(split, one):
        assert torch.equal(x.ref_logps, y.ref_logps) and torch.equal(x.rejected_ref_logps, y.rejected_ref_logps)
    assert torch.equal(whole(next(iter(sharded.parameters()))), next(iter(plain.parameters())))
    return True


@pytest.mark.parametrize("tie", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_sharded_load_reads_its_rows_and_computes_the_whole_models_bits(tie, tmp_path):
    folder = save_tiny_backbone(str(tmp_path / "bb"), seed=2, hidden=32, layers=2, heads=2, tie=tie)
    assert launch_cpu(_check_sharded, 2, folder, timeout_s=120) == {0: True, 1: True}


def test_the_weight_reader_refuses_a_cut_file_a_foreign_dtype_and_a_hostile_header(tmp_path):
    folder = save_tiny_backbone(str(tmp_path / "bb"), seed=2, hidden=32, layers=2, heads=2)
    files = WeightFiles(folder)
    name, (path, _, dtype, shape) = next(iter(files.tensors.items()))
    out = torch.empty(shape, dtype=dtype)
    files.read_rows(name, 0, out)
    cut = tmp_path / "cut"
    shutil.copytree(folder, cut)
    size = os.path.getsize(path)
    with open(cut / os.path.basename(path), "r+b") as fh:
        fh.truncate(size - 8)
    last = max(WeightFiles(str(cut)).tensors.items(), key=lambda kv: kv[1][1])
    with pytest.raises(UserError, match="ends inside .*: the file is cut short"):
        WeightFiles(str(cut)).read_rows(last[0], 0, torch.empty(last[1][3], dtype=last[1][2]))
    odd = tmp_path / "odd"
    odd.mkdir()
    header = json.dumps({"w": {"dtype": "F8_E5M2", "shape": [2], "data_offsets": [0, 2]}}).encode()
    (odd / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0")
    with pytest.raises(UserError, match="holds w as F8_E5M2, which this loader does not read"):
        WeightFiles(str(odd))
    (odd / "model.safetensors").write_bytes(struct.pack("<Q", 2 ** 62) + b"{}")     # a hostile header size
    with pytest.raises(UserError, match="is not a safetensors file"):
        WeightFiles(str(odd))
