"""B-only LoRA adapter on a real tiny Qwen3 with real PEFT (no mocks)."""
import json
import os

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from admm_dist.model.adapter import LORA_TARGETS, AdapterConfig, AdapterError, BOnlyLoRA
from admm_dist.model.vectors import check_same_basis, hash_to_int64_row, int64_row_to_hash, load_vector, save_vector
from admm_dist.demo.tiny import char_tokenizer, tiny_qwen3

HIDDEN, INTER, LAYERS = 64, 256, 2  # tiny_qwen3 defaults: 4 heads of 16, intermediate 4*hidden

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module")
def vocab():
    return len(char_tokenizer())


def base(vocab, seed=0, dtype=None):
    m = tiny_qwen3(vocab, seed=seed)
    return m.to(dtype) if dtype is not None else m


def make(vocab, *, seed=0, dtype=None, **cfg):
    cfg.setdefault("lora_rank", 4)
    cfg.setdefault("lora_layers_last", LAYERS)
    return BOnlyLoRA(base(vocab, seed, dtype), AdapterConfig(**cfg))


def batch(vocab, seed=1, n=2, t=9):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, vocab, (n, t), generator=g)


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def randomize(adapter, seed=3, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    adapter.load_vector(torch.randn(adapter.numel, generator=g) * scale)


def b_slices(adapter):
    return {name: adapter.flat[off:off + s[0] * s[1]].view(*s) for name, s, off in adapter.layout()}


def _peft_weights(adapter, which):
    """{module name: the lora_A or lora_B weight PEFT uses}, read from the model itself."""
    return {name: getattr(mod, which)["default"].weight
            for name, mod in adapter.model.get_base_model().named_modules()
            if hasattr(mod, which) and "default" in getattr(mod, which)}


def peft_b_weights(adapter):
    return _peft_weights(adapter, "lora_B")


def peft_a_weights(adapter):
    return _peft_weights(adapter, "lora_A")


# ------------------------------------------------------------------ construction

def test_only_b_trains_and_a_is_frozen_fp32(vocab):
    a = make(vocab, lora_targets="attn_all")
    trainable = [n for n, p in a.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_B.default." in n for n in trainable)
    assert len(trainable) == len(a.layout()) == 4 * LAYERS
    for w in peft_a_weights(a).values():
        assert w.dtype == torch.float32 and not w.requires_grad
        bound = 1.0 / w.shape[1] ** 0.5
        assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound  # kaiming-uniform range
    assert a.param.requires_grad and a.param.grad is a.flat_grad
    assert a.numel == sum(s[0] * s[1] for _, s, _ in a.layout()) == a.flat.numel()
    assert torch.count_nonzero(a.flat) == 0  # B starts at zero: the adapter is the identity


def test_basis_same_seed_identical_other_seed_differs(vocab):
    a1 = make(vocab, seed=0, lora_basis_seed=7)
    a2 = make(vocab, seed=5, lora_basis_seed=7)  # another backbone init, same shapes + seed
    a3 = make(vocab, seed=0, lora_basis_seed=8)
    w1, w2, w3 = peft_a_weights(a1), peft_a_weights(a2), peft_a_weights(a3)
    assert w1.keys() == w2.keys() == w3.keys()
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert not any(torch.equal(w1[k], w3[k]) for k in w1)
    assert a1.basis_hash() == a2.basis_hash() != a3.basis_hash()
    assert len(a1.basis_hash()) == 64
    assert a1.basis_hash(recompute=True) == a1.basis_hash()
    check_same_basis([a1.basis_hash(), a2.basis_hash()])
    with pytest.raises(AdapterError, match=r"ranks \[2\].*lora_basis_seed"):
        check_same_basis([a1.basis_hash(), a2.basis_hash(), a3.basis_hash()])
    row = hash_to_int64_row(a3.basis_hash())
    assert row.shape == (1, 4) and row.dtype == torch.int64
    assert int64_row_to_hash(row) == a3.basis_hash()


@pytest.mark.parametrize("targets,last,per_layer", [
    ("attn_qv", 1, 2 * HIDDEN),
    ("attn_all", 2, 4 * HIDDEN),
    ("attn_mlp", 1, 5 * HIDDEN + 2 * INTER),
])
def test_targets_module_count_and_numel(vocab, targets, last, per_layer):
    r = 4
    a = make(vocab, lora_targets=targets, lora_layers_last=last, lora_rank=r)
    names = [n for n, _, _ in a.layout()]
    assert len(names) == len(LORA_TARGETS[targets]) * last
    layers = {int(n.split(".")[2]) for n in names}
    assert layers == set(range(LAYERS - last, LAYERS))  # the LAST layers
    assert {n.rsplit(".", 1)[1] for n in names} == set(LORA_TARGETS[targets])
    assert a.numel == r * per_layer * last
    assert names == sorted(names)
    offs = [o for _, _, o in a.layout()]
    assert offs[0] == 0 and all(o2 > o1 for o1, o2 in zip(offs, offs[1:]))


@pytest.mark.parametrize("kw,msg", [
    (dict(lora_targets="attn"), "one of attn_all, attn_mlp, attn_qv"),
    (dict(lora_layers_last=0), ">= 1"),
    (dict(lora_rank=0), "lora_rank=0: use an integer >= 1 \\(default 16\\)"),
    (dict(lora_rank=2.5), "lora_rank=2.5: use an integer >= 1"),
    (dict(lora_alpha=-1.0), "lora_alpha=-1.0: use a number > 0"),
    (dict(lora_alpha=float("nan")), "lora_alpha=nan: use a number > 0"),
])
def test_config_validation(kw, msg):
    with pytest.raises(AdapterError, match=msg):
        AdapterConfig(**kw)


def test_layers_last_beyond_model(vocab):
    with pytest.raises(AdapterError, match=r"the model has 2 layers: use lora_layers_last between 1 and 2"):
        BOnlyLoRA(base(vocab), AdapterConfig(lora_layers_last=3))
    assert issubclass(AdapterError, ValueError)


# ------------------------------------------------------------------ flat vector and grads

def test_flat_aliasing_and_inplace_grads_match_reference(vocab):
    a = make(vocab, lora_targets="attn_mlp")
    randomize(a)
    ids1, ids2 = batch(vocab, 1), batch(vocab, 2)

    # reference: a plain PEFT LoRA on the same backbone with the same A and B, ordinary grads
    ref = get_peft_model(base(vocab), LoraConfig(
        r=4, lora_alpha=16.0, target_modules=list(LORA_TARGETS["attn_mlp"]),
        layers_to_transform=[0, 1], lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
    ref_mods = dict(ref.get_base_model().named_modules())
    with torch.no_grad():
        for name, w in peft_a_weights(a).items():
            ref_mods[name].lora_A["default"].weight.copy_(w)
        for name, w in peft_b_weights(a).items():
            ref_mods[name].lora_B["default"].weight.copy_(w)

    def ref_grad(ids):
        ref.zero_grad(set_to_none=True)
        lm_loss(ref, ids).backward()
        return torch.cat([ref_mods[n].lora_B["default"].weight.grad.reshape(-1)
                          for n, _, _ in a.layout()])

    g1, g2 = ref_grad(ids1), ref_grad(ids2)
    assert g1.abs().sum() > 0

    def check_views():
        for (name, (o, r), off), w in zip(a.layout(), [peft_b_weights(a)[n] for n, _, _ in a.layout()]):
            esz = 4
            assert w.data_ptr() == a.flat.data_ptr() + off * esz
            assert w.grad.data_ptr() == a.flat_grad.data_ptr() + off * esz
        assert a.param.grad is a.flat_grad

    ptr = a.flat_grad.data_ptr()
    a.zero_grad()
    lm_loss(a.model, ids1).backward()
    check_views()
    cat = torch.cat([w.grad.reshape(-1) for w in (peft_b_weights(a)[n] for n, _, _ in a.layout())])
    assert torch.equal(a.flat_grad, cat)
    torch.testing.assert_close(a.flat_grad, g1, rtol=1e-5, atol=1e-6)  # fast path: W + sBA merged
    lm_loss(a.model, ids1).backward()  # no zero_grad: accumulates in place
    torch.testing.assert_close(a.flat_grad, 2 * g1, rtol=1e-5, atol=2e-6)
    a.zero_grad()
    assert torch.count_nonzero(a.flat_grad) == 0
    lm_loss(a.model, ids2).backward()
    torch.testing.assert_close(a.flat_grad, g2, rtol=1e-5, atol=1e-7)
    check_views()
    assert a.flat_grad.data_ptr() == ptr

    # someone clears the grads the usual way: zero_grad() re-attaches the views
    a.model.zero_grad(set_to_none=True)
    a.zero_grad()
    lm_loss(a.model, ids1).backward()
    check_views()
    torch.testing.assert_close(a.flat_grad, g1, rtol=1e-5, atol=1e-6)  # fast path: W + sBA merged


def test_adam_on_flat_param_moves_model_and_peft_sees_flat(vocab):
    a = make(vocab, lora_targets="attn_qv")
    ids = batch(vocab)
    with torch.no_grad():
        before = a.model(input_ids=ids).logits.clone()
    opt = torch.optim.Adam([a.param], lr=1e-2)
    losses = []
    for _ in range(4):
        a.zero_grad()
        loss = lm_loss(a.model, ids)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert a.vector() is a.flat and a.vector().abs().sum() > 0
    with torch.no_grad():
        after = a.model(input_ids=ids).logits
    assert (after - before).abs().max() > 1e-3
    assert losses[-1] < losses[0]
    slices, weights = b_slices(a), peft_b_weights(a)
    assert slices.keys() == weights.keys()
    for name in slices:
        assert torch.equal(weights[name], slices[name])
        assert weights[name].data_ptr() == slices[name].data_ptr()
    # PEFT's own state dict (what save_pretrained writes) holds the same numbers
    from peft import get_peft_model_state_dict
    sd = get_peft_model_state_dict(a.model)
    for name in slices:
        assert torch.equal(sd[f"base_model.model.{name}.lora_B.weight"], slices[name])


def test_load_vector_and_wrong_length(vocab):
    a = make(vocab, lora_targets="attn_qv", lora_layers_last=1)
    v = torch.arange(a.numel, dtype=torch.float64)
    a.load_vector(v)
    assert torch.equal(a.vector(), v.float())
    name, (o, r), off = a.layout()[1]
    assert torch.equal(peft_b_weights(a)[name], v[off:off + o * r].float().view(o, r))
    with pytest.raises(AdapterError, match=f"P={a.numel}"):
        a.load_vector(torch.zeros(a.numel + 1))


def test_disabled_gives_base_logits(vocab):
    m = base(vocab)
    ids = batch(vocab)
    with torch.no_grad():
        ref = m(input_ids=ids).logits.clone()
    a = BOnlyLoRA(m, AdapterConfig(lora_rank=4, lora_layers_last=2))
    randomize(a, scale=0.2)
    with torch.no_grad():
        on = a.model(input_ids=ids).logits
        with a.disabled() as model:
            off = model(input_ids=ids).logits
        on_again = a.model(input_ids=ids).logits
    assert (on - ref).abs().max() > 1e-3
    torch.testing.assert_close(off, ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(on_again, on, rtol=0, atol=0)


def test_bf16_backbone_keeps_fp32_lora(vocab):
    a = make(vocab, dtype=torch.bfloat16, lora_targets="attn_all", lora_layers_last=1)
    assert all(w.dtype == torch.float32 for w in peft_a_weights(a).values())
    assert all(w.dtype == torch.float32 for w in peft_b_weights(a).values())
    assert a.flat.dtype == torch.float32
    randomize(a, scale=0.5)
    ids = batch(vocab)
    out = a.model(input_ids=ids).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    with torch.no_grad(), a.disabled() as model:
        off = model(input_ids=ids).logits
    assert (out.float() - off.float()).abs().max() > 0
    a.zero_grad()
    lm_loss(a.model, ids).backward()
    assert a.flat_grad.dtype == torch.float32 and a.flat_grad.abs().sum() > 0


# ------------------------------------------------------------------ files

def test_save_load_roundtrip(vocab, tmp_path):
    a = make(vocab, lora_targets="attn_qv")
    randomize(a)
    p = str(tmp_path / "x.safetensors")
    save_vector(p, a.vector(), {"round": 3, "note": "z"}, adapter=a)
    vec, meta = load_vector(p, a)
    assert torch.equal(vec, a.vector()) and vec.dtype == torch.float32
    assert meta["round"] == 3 and meta["note"] == "z"
    assert meta["adapter"]["basis_hash"] == a.basis_hash()
    assert meta["adapter"]["numel"] == a.numel
    assert meta["adapter"]["config"] == AdapterConfig(lora_rank=4, lora_layers_last=2,
                                                      lora_targets="attn_qv").to_dict()
    assert meta["adapter"]["layout"][0] == [a.layout()[0][0], list(a.layout()[0][1]), 0]
    # the file is plain safetensors (no pickle) and the temp file is gone
    from safetensors.torch import load_file
    assert set(load_file(p)) == {"b"}
    assert os.listdir(tmp_path) == ["x.safetensors"]
    # the adapter method loads into the live vector
    b = make(vocab, lora_targets="attn_qv", seed=9)
    b.load(p)
    assert torch.equal(b.vector(), a.vector())
    vec2, _ = load_vector(p)  # no expectation
    assert torch.equal(vec2, vec)


def test_the_same_vector_and_metadata_give_the_same_bytes(vocab, tmp_path):
    """safetensors writes its metadata map in hash order; save_vector writes one order, so a
    result file's sha256 identifies its content (a rerun of the same seed gives the same file)."""
    from safetensors import safe_open

    a = make(vocab, lora_targets="attn_qv")
    randomize(a)
    blobs = set()
    for i in range(6):
        p = tmp_path / f"v{i}.safetensors"
        save_vector(str(p), a.vector(), {"round": 3, "selection": "z", "anchor_keys": ["k2", "k1"]}, adapter=a)
        blobs.add(p.read_bytes())
    assert len(blobs) == 1
    with safe_open(str(tmp_path / "v0.safetensors"), "pt") as f:   # still a plain safetensors file
        assert f.metadata()["format"] == "admm_dist.b_vector" and torch.equal(f.get_tensor("b"), a.vector())


def test_load_errors(vocab, tmp_path):
    a = make(vocab, lora_targets="attn_qv")
    p = str(tmp_path / "x.safetensors")
    with pytest.raises(AdapterError, match="no B-vector file at"):
        load_vector(p, a)
    save_vector(p, a.vector(), {}, adapter=a)
    good = open(p, "rb").read()

    bad = str(tmp_path / "bad.safetensors")
    with open(bad, "wb") as fh:
        fh.write(b"this is not safetensors at all")
    with pytest.raises(AdapterError, match="not a readable safetensors file"):
        load_vector(bad, a)
    with open(bad, "wb") as fh:
        fh.write(good[: len(good) - 40])  # truncated
    with pytest.raises(AdapterError, match="corrupt or truncated"):
        load_vector(bad, a)

    from safetensors.torch import save_file
    save_file({"w": torch.zeros(3)}, bad)
    with pytest.raises(AdapterError, match="without key 'b'"):
        load_vector(bad, a)

    # another adapter config: the differing field is named
    other = make(vocab, lora_targets="attn_qv", lora_rank=2)
    with pytest.raises(AdapterError, match=r"lora_rank=4 but this adapter has lora_rank=2"):
        load_vector(p, other)
    other = make(vocab, lora_targets="attn_qv", lora_basis_seed=1)
    with pytest.raises(AdapterError, match=r"lora_basis_seed=42 but this adapter has lora_basis_seed=1"):
        load_vector(p, other)

    # same config, tampered identity: numel, basis hash, layout
    _, meta = load_vector(p, a)
    for field, value, msg in [("numel", a.numel + 1, "B entries but this adapter has"),
                              ("basis_hash", "0" * 64, "lora A basis 000000000000"),
                              ("layout", [], "another B layout")]:
        m = json.loads(json.dumps(meta))
        m["adapter"][field] = value
        save_vector(bad, a.vector(), m)
        with pytest.raises(AdapterError, match=msg):
            load_vector(bad, a)
    save_vector(bad, a.vector(), {"x": 1})
    with pytest.raises(AdapterError, match="no adapter identity"):
        load_vector(bad, a)
    with pytest.raises(AdapterError, match="has 3 values but the adapter has"):
        save_vector(bad, torch.zeros(3), {}, adapter=a)
    with pytest.raises(AdapterError, match="not plain JSON"):
        save_vector(bad, a.vector(), {"x": object()})


def test_export_peft_reproduces_logits(vocab, tmp_path):
    a = make(vocab, lora_targets="attn_mlp", lora_layers_last=1)
    randomize(a, scale=0.2)
    ids = batch(vocab)
    with torch.no_grad():
        want = a.model(input_ids=ids).logits.clone()
    folder = str(tmp_path / "peft")
    a.export_peft(folder)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(folder))
    assert sorted(os.listdir(tmp_path)) == ["peft"]  # no temp folder left behind
    with open(os.path.join(folder, "adapter_config.json")) as fh:   # PEFT's set, in one order every run
        targets = json.load(fh)["target_modules"]
    assert targets == sorted(a.config.target_modules) and len(targets) == 7
    assert isinstance(a.model.peft_config["default"].target_modules, set)   # the live model's is PEFT's own
    loaded = PeftModel.from_pretrained(base(vocab), folder)
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    with torch.no_grad():
        base_logits = base(vocab)(input_ids=ids).logits
    assert (want - base_logits).abs().max() > 1e-3

    # export another vector over the existing folder: the live vector is left alone
    live = a.vector().clone()
    v2 = -live
    a.export_peft(folder, v2)
    assert torch.equal(a.vector(), live)
    assert sorted(os.listdir(tmp_path)) == ["peft"]
    loaded2 = PeftModel.from_pretrained(base(vocab), folder)
    a.load_vector(v2)
    with torch.no_grad():
        torch.testing.assert_close(loaded2(input_ids=ids).logits, a.model(input_ids=ids).logits,
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_export_peft_gives_the_modes_of_a_plain_mkdir_and_open(vocab, tmp_path, umask):
    """The PEFT folder and every file in it get 0777/0666 less the umask (a serving account
    reads them), not mkdtemp's 0700 and the safetensors writer's 0600; also over an old folder."""
    a = make(vocab, lora_targets="attn_all", lora_layers_last=1)
    folder = tmp_path / "run-last-peft"
    old = os.umask(umask)
    try:
        for _ in range(2):      # a new folder, then one replacing it
            a.export_peft(str(folder))
            assert os.stat(folder).st_mode & 0o777 == 0o777 & ~umask
            files = [os.path.join(root, fn) for root, _, fns in os.walk(folder) for fn in fns]
            assert "adapter_model.safetensors" in {os.path.basename(f) for f in files}
            assert {f: os.stat(f).st_mode & 0o777 for f in files} == {f: 0o666 & ~umask for f in files}
            for root, dirs, _ in os.walk(folder):
                assert all(os.stat(os.path.join(root, d)).st_mode & 0o777 == 0o777 & ~umask for d in dirs)
    finally:
        os.umask(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_b_only_forward_matches_peft_generic_forward(vocab, dtype):
    """The fused B-only layer computes what PEFT's LoRA layer computes, values and B grads."""
    from admm_dist.model.adapter import AdapterConfig, BOnlyLoRA
    from admm_dist.demo.tiny import tiny_qwen3

    ids = batch(vocab, 3)
    outs = []
    for fast in (True, False):
        model = tiny_qwen3(vocab, hidden=32, layers=2, heads=2, seed=5).to(dtype)
        ad = BOnlyLoRA(model, AdapterConfig(lora_rank=4, lora_alpha=8.0, lora_layers_last=2,
                                            lora_basis_seed=3), fast_path=fast)
        torch.manual_seed(0)
        ad.load_vector(0.1 * torch.randn(ad.numel))
        ad.zero_grad()
        logits = ad.model(ids).logits
        logits.float().logsumexp(-1).mean().backward()
        outs.append((logits.detach().float(), ad.flat_grad.clone()))
        with ad.disabled():  # adapters off goes through PEFT's own path either way
            outs[-1] += (ad.model(ids).logits.detach().float(),)
    (l1, g1, d1), (l2, g2, d2) = outs
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(l1, l2, rtol=tol, atol=tol)
    assert float((g1 - g2).norm() / g2.norm()) < (1e-5 if dtype == torch.float32 else 3e-2)
    assert torch.equal(d1, d2)
