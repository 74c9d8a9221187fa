"""The backbone sharded over a seat group (model/sharding.py): each of 2 real gloo ranks reads only
its rows of every weight, and the sharded model computes the whole model's bits (logits,
B gradients), digest and norms; reference log-probs split over the group are the single
rank's. The weight reader takes the files transformers takes (``model.safetensors``, else its
index's files; a stray file is ignored) and refuses in one line naming file and tensor what the
safetensors library refuses (an edited header: overlapping or cut ranges, malformed entries), a
name held by two files of an index, a hostile index, a FIFO or a device in place of the weights
(at once, never blocking) and a config.json whose shapes are not the files' (before allocating)."""
import json
import os
import resource
import shutil
import struct
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from safetensors.torch import load_file, save_file

from admm_dist.core.errors import UserError
from admm_dist.data.fitset import Example
from admm_dist.bench.launcher import launch_cpu
from admm_dist.engine.seat_group import SeatGroup
from admm_dist.model import batches as bt
from admm_dist.model import objectives as obj
from admm_dist.model import sharding
from admm_dist.model.adapter import AdapterConfig, BOnlyLoRA
from admm_dist.model.loading import load_model
from admm_dist.model.sharding import WeightFiles, held_bytes, whole
from admm_dist.demo.tiny import save_tiny_backbone

CPU = torch.device("cpu")
NORM, UP, GATE = "model.norm.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_proj.weight"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny backbone's folder, written once for the module; tests copy it (:func:`_copy`)."""
    return save_tiny_backbone(str(tmp_path_factory.mktemp("tiny") / "bb"), seed=2, hidden=32, layers=2, heads=2)


def _copy(tiny, tmp_path, name="m"):
    return shutil.copytree(tiny, str(tmp_path / name))


@pytest.fixture
def one_rank():
    """A 1-rank gloo process group in this process, as load_sharded's 1-D mesh; removed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield DeviceMesh.from_group(dist.group.WORLD, "cpu")
    dist.destroy_process_group()


def _edit_header(path, edit):
    """Rewrite the safetensors file ``path`` with its JSON header changed by ``edit(header)``:
    8 bytes of little-endian length, the JSON padded with spaces to a multiple of 8, the data."""
    with open(path, "rb") as fh:
        size = struct.unpack("<Q", fh.read(8))[0]
        header, data = json.loads(fh.read(size)), fh.read()
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text + data)


def _refused(fn, *pieces):
    """The one-line UserError ``fn()`` raises, checked to hold every piece."""
    with pytest.raises(UserError) as info:
        fn()
    text = str(info.value)
    assert "\n" not in text and all(p in text for p in pieces), text
    return text


def _within(seconds, fn, unblock=None):
    """What ``fn()`` raises, in a thread given ``seconds``: a loader that blocks (in open() on a
    FIFO, say) fails the test instead of hanging it; ``unblock()`` then frees the thread."""
    box = {}

    def run():
        try:
            fn()
        except BaseException as exc:    # noqa: B036 - handed to the test
            box["exc"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if unblock is not None:
            unblock()
        pytest.fail(f"the loader was still blocked after {seconds} s")
    return box.get("exc")


def _same_as_unsharded(folder, group):
    """The 1-rank sharded load of ``folder`` has the unsharded load's parameters, bit for bit."""
    sharded, _ = load_model(folder, CPU, shard_over=group)
    plain = dict(load_model(folder, CPU)[0].named_parameters())
    for name, p in sharded.named_parameters():
        assert torch.equal(p.to_local(), plain[name]), name
    return plain


def _examples(tok, n=11):
    rows = [Example(seat=0, role="Solver", anchor=f"q{i}", prompt=f"Q:{i}" + "x" * (i % 3),
                    target="yes" + "!" * (i % 2), rejected="no" + "." * (i % 3)) for i in range(n)]
    return bt.encode(tok, rows, obj.ObjectiveConfig())


def _check_sharded(ctx, folder):
    cpu = torch.device("cpu")
    group = dist.group.WORLD
    sharded, tok = load_model(folder, cpu, shard_over=DeviceMesh.from_group(group, "cpu"))
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


def test_the_weight_reader_casts_its_rows_and_refuses_a_cut_file_a_foreign_dtype_and_a_bad_header_size(tiny, tmp_path):
    folder = _copy(tiny, tmp_path)
    files, want = WeightFiles(folder), load_file(os.path.join(folder, "model.safetensors"))
    assert set(files.tensors) == set(want)
    for name, (path, dtype, shape) in files.tensors.items():
        assert path == os.path.join(folder, "model.safetensors")
        assert (dtype, shape) == (want[name].dtype, want[name].shape)
        out = torch.empty((shape[0] - 1,) + shape[1:], dtype=torch.bfloat16)       # rows 1.., cast
        files.read_rows(name, 1, out)
        assert torch.equal(out, want[name][1:].bfloat16()), name
    path = os.path.join(folder, "model.safetensors")
    with open(path, "r+b") as fh:         # cut short after the header was read: read again, refused
        fh.truncate(os.path.getsize(path) - 8)
    _refused(lambda: files.read_rows(NORM, 0, torch.empty(32)),
             f"shard_backbone: {path} is not a valid safetensors file (", "file not fully covered", "download it again")
    _refused(lambda: WeightFiles(folder), path, "file not fully covered")
    header = json.dumps({"w": {"dtype": "F8_E5M2", "shape": [2], "data_offsets": [0, 2]}}).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header + b"\0\0")
    _refused(lambda: WeightFiles(folder), f"{path} holds w as F8_E5M2, which this loader does not read")
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", 2 ** 62) + b"{}")      # a hostile header size
    _refused(lambda: WeightFiles(folder), f"{path} is not a valid safetensors file (header too large)")


EDITS = {   # an edit of model.safetensors' header -> what the refusal says of it
    "overlap": (lambda h: h[UP].update(data_offsets=h[GATE]["data_offsets"]), "invalid offset"),
    "cut range": (lambda h: h[NORM].update(data_offsets=[0, 4]), "invalid shape, data type, or offset; its entry: "
                  '{"dtype": "F32", "shape": [32], "data_offsets": [0, 4]}'),
    "the header's own bytes": (lambda h: h[NORM].update(data_offsets=[-256, 0]), "integer `-256`, expected usize"),
    "no dtype": (lambda h: h[NORM].pop("dtype"), "missing field `dtype`"),
    "an int": (lambda h: h.__setitem__(NORM, 5), "invalid type: integer `5`"),
    "a list": (lambda h: h.__setitem__(NORM, [0, 4]), "invalid type: integer `0`"),
    "a string offset": (lambda h: h[NORM].update(data_offsets=["0", 128]), 'invalid type: string "0"'),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_header_is_refused_in_one_line_naming_the_file_and_the_tensor(edit, tiny, tmp_path):
    folder = _copy(tiny, tmp_path)
    path = os.path.join(folder, "model.safetensors")
    change, says = EDITS[edit]
    _edit_header(path, change)
    text = _refused(lambda: WeightFiles(folder), f"shard_backbone: {path} is not a valid safetensors file (tensor ",
                    says, "): download it again")
    # the two tensors of one range: the library names the second of them, in an order of its own
    named = (f"tensor {UP}:", f"tensor {GATE}:") if edit == "overlap" else (f"tensor {NORM}:",)
    assert any(n in text for n in named), text


def test_a_stray_weights_file_is_ignored_and_the_sharded_load_gives_the_unsharded_bits(tiny, tmp_path, one_rank):
    folder = _copy(tiny, tmp_path)
    want = load_file(os.path.join(folder, "model.safetensors"))
    save_file({k: v * 0.5 if ".mlp." in k else v for k, v in want.items()}, os.path.join(folder, "zz-old.safetensors"))
    plain = _same_as_unsharded(folder, one_rank)
    assert all(torch.equal(plain[k], want[k]) for k in plain)
    files = WeightFiles(folder)
    assert {path for path, _, _ in files.tensors.values()} == {os.path.join(folder, "model.safetensors")}


def test_a_snapshot_of_links_to_its_blobs_is_read_as_the_files_themselves(tiny, tmp_path, one_rank):
    blobs, folder = _copy(tiny, tmp_path, "blobs"), tmp_path / "snapshot"
    folder.mkdir()
    for name in os.listdir(blobs):          # as huggingface_hub lays out a snapshot
        os.symlink(os.path.join(blobs, name), folder / name)
    assert len(WeightFiles(str(folder)).tensors) == len(load_file(os.path.join(blobs, "model.safetensors")))
    _same_as_unsharded(str(folder), one_rank)


def _split(tiny, tmp_path, name="m"):
    """A copy of the tiny backbone whose weights are two files and an index, as save_pretrained
    writes a large model: the layers' tensors in b.safetensors, the rest in a.safetensors."""
    folder = _copy(tiny, tmp_path, name)
    want = load_file(os.path.join(folder, "model.safetensors"))
    os.remove(os.path.join(folder, "model.safetensors"))
    where = {k: "b.safetensors" if ".layers." in k else "a.safetensors" for k in want}
    for file in ("a.safetensors", "b.safetensors"):
        save_file({k: v for k, v in want.items() if where[k] == file}, os.path.join(folder, file))
    _write_index(folder, where)
    return folder, want, where


def _write_index(folder, weight_map):
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)


def test_an_index_is_followed_as_transformers_follows_it(tiny, tmp_path, one_rank):
    folder, want, where = _split(tiny, tmp_path)
    files = WeightFiles(folder)
    assert {k: os.path.basename(path) for k, (path, _, _) in files.tensors.items()} == where
    _same_as_unsharded(folder, one_rank)
    # a model.safetensors beside an index is what transformers reads: the index is then not read
    save_file({k: v * 0.5 for k, v in want.items()}, os.path.join(folder, "model.safetensors"))
    assert {path for path, _, _ in WeightFiles(folder).tensors.values()} == {os.path.join(folder, "model.safetensors")}
    plain = _same_as_unsharded(folder, one_rank)
    assert torch.equal(plain[NORM], want[NORM] * 0.5)


def test_a_name_held_by_two_files_of_an_index_and_a_hostile_index_are_refused_in_one_line(tiny, tmp_path, monkeypatch):
    folder, want, where = _split(tiny, tmp_path)
    index = os.path.join(folder, "model.safetensors.index.json")
    save_file({k: v for k, v in want.items() if where[k] == "b.safetensors" or k == NORM},
              os.path.join(folder, "b.safetensors"))
    _refused(lambda: WeightFiles(folder), f"shard_backbone: {NORM} is held by both a.safetensors and b.safetensors, "
             f"files of {index}: which one counts is not clear; download the model again")
    folder, want, where = _split(tiny, tmp_path, "m2")
    index = os.path.join(folder, "model.safetensors.index.json")
    _write_index(folder, dict(where, **{NORM: "b.safetensors"}))
    _refused(lambda: WeightFiles(folder), f"shard_backbone: {index} puts {NORM} in b.safetensors, which does not "
             f"hold it (a.safetensors does): download the model again")
    for file in ("../m/a.safetensors", os.path.join(folder, "a.safetensors"), "sub/a.safetensors", "..", "a\nb"):
        _write_index(folder, dict(where, **{NORM: file}))
        _refused(lambda: WeightFiles(folder), f"shard_backbone: {index} names the file {ascii(file)}, which is not a "
                 f"plain file name inside the model folder: download the model again")
    _write_index(folder, dict(where, **{NORM: "c.safetensors"}))
    _refused(lambda: WeightFiles(folder), f"{index} names c.safetensors, which is not a file of {folder}")
    for text, says in (("{", "is not a JSON object (JSONDecodeError: "), ("[]", "is not a JSON object (AttributeError"),
                       ("[" * 100000, "is not a JSON object (RecursionError"),
                       ('{"weight_map": [1]}', "has no weight_map of tensor names to file names"),
                       ('{"weight_map": {"w": 1}}', "has no weight_map of tensor names to file names")):
        with open(index, "w") as fh:
            fh.write(text)
        _refused(lambda: WeightFiles(folder), f"shard_backbone: {index} {says}")
    _write_index(folder, where)
    monkeypatch.setattr(sharding, "MAX_INDEX", 64)
    _refused(lambda: WeightFiles(folder), f"{index} is larger than 64 bytes, the ceiling of an index")


@pytest.mark.parametrize("kind", ["fifo", "link to a fifo", "link to /dev/zero"])
def test_a_fifo_or_a_device_in_place_of_the_weights_is_refused_at_once(kind, tiny, tmp_path):
    folder = _copy(tiny, tmp_path)
    path = os.path.join(folder, "model.safetensors")
    os.remove(path)
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    target = {"fifo": None, "link to a fifo": fifo, "link to /dev/zero": "/dev/zero"}[kind]
    if target is None:
        os.mkfifo(path)
    else:
        os.symlink(target, path)

    def unblock():   # a writer lets a reader blocked in open() go on, to an empty file
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    start = time.monotonic()
    exc = _within(10, lambda: WeightFiles(folder), unblock)
    kind_said = "a device (through a symbolic link)" if "zero" in kind else \
        "a FIFO (through a symbolic link)" if "link" in kind else "a FIFO"
    assert isinstance(exc, UserError) and str(exc) == (
        f"shard_backbone: {path} is {kind_said}, not a regular file: put the model's own file there (nothing was "
        f"read from it)"), exc
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("key,value,says", [
    ("vocab_size", 10 ** 12, "model.embed_tokens.weight is [1000000000000, 32] by {config} but [102, 32] in "
                             "{weights}: the config does not match the weights (nothing was allocated); download the "
                             "model again"),
    ("hidden_size", 2 ** 40, "model.embed_tokens.weight is [102, 1099511627776] by {config} but [102, 32] in {weights}"),
    ("num_hidden_layers", 3, "{folder} has no tensor model.layers.2."),
], ids=["vocab_size", "hidden_size", "a layer more"])
def test_a_config_that_does_not_match_the_weights_is_refused_before_anything_is_allocated(
        key, value, says, tiny, tmp_path, one_rank):
    folder = _copy(tiny, tmp_path)
    config = os.path.join(folder, "config.json")
    with open(config) as fh:
        settings = json.load(fh)
    settings[key] = value
    if key == "num_hidden_layers":
        settings["layer_types"] = ["full_attention"] * value
    with open(config, "w") as fh:
        json.dump(settings, fh)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _refused(lambda: load_model(folder, CPU, shard_over=one_rank),
             "shard_backbone: " + says.format(config=config, weights=os.path.join(folder, "model.safetensors"),
                                              folder=folder))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 64 * 1024     # KiB: no backbone's worth
