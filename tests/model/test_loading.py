"""Loading a backbone: its dtype is chosen in one function (backbone_dtype), from the device
unless the run names one, and a bad dtype is one line naming the choices; a model folder
holding a FIFO or a device (or a link to one) is refused at once, in one line naming it, before
either loader opens anything, while a hub snapshot's links to regular files load."""
import os
import shutil
import threading

import pytest
import torch

from admm_dist.core.errors import UserError
from admm_dist.model.loading import DTYPES, backbone_dtype, check_model_src, load_model

from conftest import REPO

TINY = os.path.join(str(REPO), "assets", "tiny", "backbone")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_is_bf16_on_cuda_and_fp32_on_cpu_and_a_named_dtype_is_taken_as_given():
    assert backbone_dtype(CPU) is torch.float32 and backbone_dtype(CUDA) is torch.bfloat16
    assert backbone_dtype(CPU, "bfloat16") is torch.bfloat16 and backbone_dtype(CUDA, "float32") is torch.float32
    assert DTYPES == ("auto", "float32", "bfloat16")
    with pytest.raises(UserError, match="dtype='float16': use one of auto, float32, bfloat16"):
        backbone_dtype(CPU, "float16")


def test_a_bfloat16_backbone_loads_in_bfloat16_on_cpu_and_gives_the_float32_ones_logits_to_round_off():
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    fp32, _ = load_model(TINY, CPU)
    bf16, _ = load_model(TINY, CPU, dtype="bfloat16")
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        a, b = fp32(input_ids=ids).logits, bf16(input_ids=ids).logits.float()
    assert not torch.equal(a, b) and float((a - b).abs().max()) < 0.1 * float(a.abs().max())


def _refusal_within(seconds, fn, unblock):
    """The UserError ``fn()`` raises, in a thread given ``seconds``: a loader blocked in open()
    fails the test instead of hanging it (``unblock()`` then lets the thread go)."""
    box = {}

    def run():
        try:
            fn()
        except UserError as exc:
            box["exc"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        unblock()
        pytest.fail(f"the loader was still blocked after {seconds} s")
    assert "exc" in box, "the folder was not refused"
    return str(box["exc"])


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_fifo_or_a_link_to_a_device_in_a_model_folder_is_refused_at_once_by_the_unsharded_loader(name, tmp_path):
    folder = str(tmp_path / "m")
    shutil.copytree(TINY, folder)
    path = os.path.join(folder, name)
    os.remove(path)
    os.mkfifo(path)

    def unblock():   # a writer lets a reader blocked in open() go on, to an empty file
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert _refusal_within(10, lambda: load_model(folder, CPU), unblock) == (
        f"--model_name {folder}: {path} is a FIFO, not a regular file: put the model's own file there (nothing was "
        f"read from it)")
    os.remove(path)
    os.symlink("/dev/zero", path)
    assert _refusal_within(10, lambda: load_model(folder, CPU), unblock) == (
        f"--model_name {folder}: {path} is a device (through a symbolic link), not a regular file: put the model's "
        f"own file there (nothing was read from it)")
    os.remove(path)
    os.symlink(os.path.join(folder, "gone"), path)
    with pytest.raises(UserError, match=f"{path} cannot be read \\(No such file or directory\\): remove it"):
        check_model_src(folder)


def test_links_to_regular_files_as_in_a_hub_snapshot_load(tmp_path):
    blobs, folder = tmp_path / "blobs", tmp_path / "snapshot"
    shutil.copytree(TINY, blobs)
    folder.mkdir()
    for name in os.listdir(blobs):
        os.symlink(blobs / name, folder / name)
    model, _ = load_model(str(folder), CPU)
    plain, _ = load_model(TINY, CPU)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
