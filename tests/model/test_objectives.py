"""Node objectives on a real tiny Qwen3 with a real PEFT LoRA (lora_A frozen, as in training)."""
import contextlib
import json
import math

import pytest
import torch

from admm_dist.core.errors import UserError
from admm_dist.core.text import visible
from admm_dist.data import sampler as S
from admm_dist.model import batches as B
from admm_dist.model import objectives as O
from admm_dist.demo.tiny import char_tokenizer, tiny_qwen3

try:
    from admm_dist.data.fitset import Example
except ImportError:  # pragma: no cover - fitset.py is written in parallel
    import dataclasses
    from typing import Optional

    @dataclasses.dataclass(kw_only=True)
    class Example:
        seat: int
        role: str
        anchor: str
        prompt: str
        target: str
        rejected: Optional[str] = None
        rejected_prompt: Optional[str] = None
        reward: float = 0.0
        rejected_reward: Optional[float] = None
        advantage: float = 0.0
        success: Optional[bool] = None
        node: int = -1


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def make_model(tok, *, random_b=False, seed=0):
    from peft import LoraConfig, get_peft_model

    base = tiny_qwen3(len(tok), hidden=32, layers=2, heads=2, seed=seed)
    model = get_peft_model(base, LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]))
    for name, p in model.named_parameters():
        if "lora_A" in name:
            p.requires_grad_(False)
        if random_b and "lora_B" in name:
            with torch.no_grad():
                p.normal_(0.0, 0.3)
    return model


def lora_b(model):
    return [p for n, p in model.named_parameters() if "lora_B" in n]


def decoder(model):
    """The Qwen3Model inside the PEFT wrapper (every forward passes through it once)."""
    return model.get_base_model().model


def chat(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                   add_generation_prompt=True)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


class ForwardCounter:
    """Counts forwards of the decoder, separately inside and outside the reference context."""

    def __init__(self, model):
        self.model, self.inside = model, False
        self.ref = self.policy = 0
        self.rows = []
        decoder(model).register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if self.inside:
            self.ref += 1
        else:
            self.policy += 1

    @contextlib.contextmanager
    def ref_context(self):
        with self.model.disable_adapter():
            self.inside = True
            try:
                yield
            finally:
                self.inside = False


def pref_set(tok, n=8, role="Solver"):
    return [Example(seat=0, role=role, anchor=f"q{i}", prompt=chat(tok, f"Q:{i}" + "x" * (i % 3)),
                    target="yes" + "!" * (i % 2), rejected="no" + "." * (i % 3))
            for i in range(n)]


# ----------------------------------------------------------------------------- config, encode

def test_config_validation_names_the_fix():
    with pytest.raises(ValueError, match="fit_mode to one of dpo, sft, rsft"):
        O.ObjectiveConfig(fit_mode="ppo")
    with pytest.raises(ValueError, match="target_span"):
        O.ObjectiveConfig(target_span="hidden")
    with pytest.raises(ValueError, match="dpo_beta"):
        O.ObjectiveConfig(dpo_beta=0.0)
    with pytest.raises(ValueError, match="max_prompt_tokens=0: use an integer >= 1"):
        O.ObjectiveConfig(max_prompt_tokens=0)
    with pytest.raises(UserError, match="kl_beta"):     # a one-line user error, exit code 2
        O.ObjectiveConfig(kl_beta=-1.0)


def test_encode_truncation_and_visible_mask(tok):
    prompt = chat(tok, "What is 12+30?")
    p_ids = ids(tok, prompt)
    think = "<think>ab</think>cd"
    exs = [
        Example(seat=0, role="P", anchor="a", prompt=prompt, target=think),
        Example(seat=0, role="P", anchor="b", prompt=prompt, target="plain"),
        Example(seat=0, role="P", anchor="c", prompt=prompt, target="<think>long thoughts</think>x"),
        Example(seat=0, role="P", anchor="d", prompt=prompt, target=""),
    ]
    enc = B.encode(tok, exs, O.ObjectiveConfig(fit_mode="sft", target_span="visible",
                                               max_prompt_tokens=7, max_target_tokens=6))
    # the third target is cut inside its think block (no visible token left), the fourth is empty
    assert [e.example_index for e in enc] == [0, 1]
    assert enc.stats["skipped_empty_target"] == 2 and enc.stats["kept"] == 2
    assert enc.stats["prompt_truncated"] == 2 and enc.stats["target_truncated"] == 0
    # prompt: the LAST 7 tokens (left truncation); no special token added
    assert enc[0].prompt_ids == p_ids[-7:] and len(p_ids) > 7
    assert tok.decode(enc[0].prompt_ids) == "istant\n"
    # target: "<think>", a, b, "</think>", c, d -> 6 tokens, scored only after </think>
    assert enc[0].target_ids == ids(tok, think)
    assert enc[0].target_ids[3] == tok.convert_tokens_to_ids("</think>")
    assert enc[0].target_mask == [0, 0, 0, 0, 1, 1]
    # no </think>: every token counts; right truncation keeps the first 6 tokens
    assert enc[1].target_mask == [1] * 5
    long = B.encode(tok, [Example(seat=0, role="P", anchor="e", prompt=prompt,
                                  target="abcdefghij")],
                    O.ObjectiveConfig(fit_mode="sft", max_target_tokens=6))
    assert long[0].target_ids == ids(tok, "abcdef") and long[0].target_mask == [1] * 6
    assert long.stats["target_truncated"] == 1 and long.stats["prompt_truncated"] == 0
    # full span scores the think block too
    full = B.encode(tok, exs[:1], O.ObjectiveConfig(fit_mode="sft"))
    assert full[0].target_mask == [1] * 6 and full[0].prompt_ids == p_ids
    # two </think>: the visible span starts after the LAST one, as in admm_dist.core.text.visible
    two = "<think>a</think>b</think>cd"
    enc2 = B.encode(tok, [Example(seat=0, role="P", anchor="f", prompt=prompt, target=two)],
                    O.ObjectiveConfig(fit_mode="sft", target_span="visible"))
    assert enc2[0].target_ids == ids(tok, two) and len(enc2[0].target_ids) == 7
    assert enc2[0].target_mask == [0, 0, 0, 0, 0, 1, 1]
    assert tok.decode([t for t, m in zip(enc2[0].target_ids, enc2[0].target_mask) if m]) \
        == visible(two)


def test_encode_dpo_and_rsft(tok):
    p1, p2 = chat(tok, "one"), chat(tok, "two!")
    pair = Example(seat=1, role="Critic", anchor="a", prompt=p1, target="good",
                   rejected="bad", rejected_prompt=p2)
    same = Example(seat=1, role="Critic", anchor="b", prompt=p1, target="ok", rejected="ko")
    empty = Example(seat=1, role="Critic", anchor="c", prompt=p1, target="ok", rejected="")
    enc = B.encode(tok, [pair, same, empty], O.ObjectiveConfig(fit_mode="dpo"))
    assert len(enc) == 2 and enc.stats["skipped_empty_rejected"] == 1
    assert enc[0].prompt_ids == ids(tok, p1) and enc[0].rejected_prompt_ids == ids(tok, p2)
    assert enc[1].rejected_prompt_ids == enc[1].prompt_ids
    assert enc[0].target_ids == ids(tok, "good") and enc[0].rejected_ids == ids(tok, "bad")
    with pytest.raises(ValueError, match="rejected message"):
        B.encode(tok, [Example(seat=0, role="P", anchor="x", prompt=p1, target="t")],
                 O.ObjectiveConfig(fit_mode="dpo"))
    sft = [Example(seat=0, role="P", anchor=str(i), prompt=p1, target="t", success=s)
           for i, s in enumerate([True, False, None])]
    rs = B.encode(tok, sft, O.ObjectiveConfig(fit_mode="rsft"))
    assert [e.example_index for e in rs] == [0] and rs.stats["skipped_not_successful"] == 2
    assert not rs[0].paired and len(B.encode(tok, sft, O.ObjectiveConfig(fit_mode="sft"))) == 3


# ----------------------------------------------------------------------------- log-probs

def naive_logps(model, prompt_ids, target_ids):
    seq = torch.tensor([prompt_ids + target_ids])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0].float()
    lp = logits.log_softmax(-1)
    n = len(prompt_ids)
    return torch.stack([lp[n + j - 1, t] for j, t in enumerate(target_ids)])


def test_token_logps_matches_naive_per_sequence(tok):
    model = make_model(tok, random_b=True)
    exs = [Example(seat=0, role="P", anchor=str(i), prompt=chat(tok, "q" * (1 + 4 * i)),
                   target="<think>" + "t" * i + "</think>" + "ans" * (3 - i),
                   rejected="r" * (2 + 3 * i), rejected_prompt=chat(tok, "z" * (7 - 2 * i)))
           for i in range(3)]
    for span in ("full", "visible"):
        enc = B.encode(tok, exs, O.ObjectiveConfig(fit_mode="dpo", target_span=span))
        batch = B.collate(enc, tok.pad_token_id)
        assert batch.n_rows == 6 and batch.paired
        assert (batch.attention_mask.sum(1) < batch.attention_mask.shape[1]).any()  # padded
        with torch.no_grad():
            got = O.token_logps(model, batch)
        rows = [e.rows()[0] for e in enc] + [e.rows()[1] for e in enc]
        for r, (p, t, m, _) in enumerate(rows):
            want = naive_logps(model, p, t) * torch.tensor(m, dtype=torch.float32)
            assert torch.allclose(got[r, :len(t)], want, atol=1e-5, rtol=0), (span, r)
            assert (got[r, len(t):] == 0).all()
        unscored = (batch.target_mask == 0) & (batch.target_ids != 0)  # real, unscored tokens
        assert unscored.any() == (span == "visible")          # the think blocks of the chosen rows
        assert (got[unscored] == 0).all()


def test_the_lm_head_in_chunks_gives_the_same_log_probs_and_gradient(tok, monkeypatch):
    """A batch of more scored tokens than HEAD_CHUNK goes through the LM head a chunk at a time
    (each chunk's logits made again for its backward): the same values and the same gradient."""
    model = make_model(tok, random_b=True)
    exs = [Example(seat=0, role="P", anchor=str(i), prompt=chat(tok, "q" * (1 + 4 * i)),
                   target="ans" * (2 + i), rejected="r" * (2 + 3 * i), rejected_prompt=chat(tok, "z" * (7 - 2 * i)))
           for i in range(3)]
    batch = B.collate(B.encode(tok, exs, O.ObjectiveConfig(fit_mode="dpo")), tok.pad_token_id)
    b = lora_b(model)

    def logps_and_grad():
        for p in b:
            p.grad = None
        lp = O.token_logps(model, batch)
        lp.sum().backward()
        return lp.detach(), [p.grad.clone() for p in b]

    whole, whole_grad = logps_and_grad()
    scored = int((batch.target_mask > 0).sum())
    monkeypatch.setattr(O, "HEAD_CHUNK", 5)
    assert scored > 3 * O.HEAD_CHUNK
    chunked, chunked_grad = logps_and_grad()
    assert torch.allclose(chunked, whole, atol=1e-6, rtol=0)
    assert all(torch.allclose(c, w, atol=1e-6, rtol=1e-5) for c, w in zip(chunked_grad, whole_grad))


def test_chosen_and_rejected_in_one_forward(tok):
    model = make_model(tok)
    counter = ForwardCounter(model)
    seen = []
    decoder(model).register_forward_pre_hook(
        lambda mod, args, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    enc = B.encode(tok, pref_set(tok, 4), O.ObjectiveConfig())
    O.precompute_reference(model, enc, batch_size=4, ref_context=counter.ref_context,
                           pad_id=tok.pad_token_id)
    assert counter.ref == 1 and counter.policy == 0
    batch = B.collate(enc, tok.pad_token_id)
    seen.clear()
    loss, _ = O.loss(model, batch, O.ObjectiveConfig())
    loss.backward()
    assert counter.policy == 1 and len(seen) == 1 and seen[0][0] == 8  # 4 chosen + 4 rejected


# ----------------------------------------------------------------------------- objectives

def test_at_zero_b_kl_is_zero_and_dpo_is_log2(tok):
    model = make_model(tok)  # PEFT initialises lora_B to 0: policy == reference
    assert all((p == 0).all() for p in lora_b(model))
    cfg = O.ObjectiveConfig(kl_beta=0.5)
    enc = B.encode(tok, pref_set(tok, 6), cfg)
    O.precompute_reference(model, enc, batch_size=6, ref_context=model.disable_adapter,
                           pad_id=tok.pad_token_id)
    loss, m = O.loss(model, B.collate(enc, tok.pad_token_id), cfg)
    assert m["kl"] == 0.0 and m["margin"] == 0.0 and m["pref_acc"] == 0.0
    assert m["dpo_loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)


def test_sft_loss_is_token_nll_plus_kl(tok):
    model = make_model(tok, random_b=True)
    exs = [Example(seat=0, role="P", anchor=str(i), prompt=chat(tok, f"Q{i}"),
                   target="ans" * (i + 1), success=True) for i in range(3)]
    cfg0 = O.ObjectiveConfig(fit_mode="rsft", kl_beta=0.0)
    enc = B.encode(tok, exs, cfg0)
    batch = B.collate(enc, tok.pad_token_id)
    loss, m = O.loss(model, batch, cfg0)
    want = -torch.cat([naive_logps(model, e.prompt_ids, e.target_ids) for e in enc]).mean()
    assert loss.item() == pytest.approx(float(want), abs=1e-5) and "kl" not in m
    assert O.nll(model, [batch]) == pytest.approx(float(want), abs=1e-5)
    tot, cnt = O.nll_sum(model, enc, 2, tok.pad_token_id)      # two batches: 2 + 1 records
    assert cnt == sum(len(e.target_ids) for e in enc)
    assert tot / cnt == pytest.approx(float(want), abs=1e-5)
    assert O.nll_sum(model, [], 2, tok.pad_token_id) == (0.0, 0.0)
    with pytest.raises(ValueError, match="precompute_reference"):
        O.loss(model, batch, O.ObjectiveConfig(fit_mode="sft", kl_beta=0.1))
    O.precompute_reference(model, enc, batch_size=2, ref_context=model.disable_adapter)
    cfg = O.ObjectiveConfig(fit_mode="sft", kl_beta=0.1)
    loss, m = O.loss(model, B.collate(enc, tok.pad_token_id), cfg)
    assert m["kl"] > 0 and loss.item() == pytest.approx(m["nll"] + 0.1 * m["kl"], rel=1e-6)
    with pytest.raises(ValueError, match="same fit_mode"):
        O.loss(model, batch, O.ObjectiveConfig(fit_mode="dpo"))


def test_dpo_training_learns_preferences_and_reference_is_computed_once(tok):
    torch.manual_seed(0)
    model = make_model(tok)
    counter = ForwardCounter(model)
    cfg = O.ObjectiveConfig(dpo_beta=0.5, kl_beta=0.05)
    enc = B.encode(tok, pref_set(tok, 8), cfg)
    assert O.precompute_reference(model, enc, batch_size=3, ref_context=counter.ref_context,
                                  pad_id=tok.pad_token_id) == 8
    assert counter.ref == 3  # ceil(8 / 3) batches, each one forward
    frozen = [(e.ref_logps.clone(), e.rejected_ref_logps.clone()) for e in enc]

    opt = torch.optim.Adam(lora_b(model), lr=2e-2)
    sampler = S.RoleBalancedSampler(enc, 4, seed=0)
    batch_all = B.collate(enc, tok.pad_token_id)
    with torch.no_grad():
        _, before = O.loss(model, batch_all, cfg)
    model.train()
    for _ in range(12):
        batch = B.collate([enc[i] for i in sampler.next_batch()], tok.pad_token_id)
        loss, _ = O.loss(model, batch, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        _, after = O.loss(model, batch_all, cfg)
    assert after["dpo_loss"] < before["dpo_loss"] - 0.3     # log 2 = 0.69 -> about 0.2
    assert before["pref_acc"] == 0.0 and after["pref_acc"] >= 0.875
    assert after["margin"] > 0 and after["kl"] > 0

    # the reference was never recomputed: no forward under the reference context during
    # training, values unchanged, and a second precompute is a no-op
    assert counter.ref == 3 and counter.policy == 14
    for e, (c, r) in zip(enc, frozen):
        assert torch.equal(e.ref_logps, c) and torch.equal(e.rejected_ref_logps, r)
    assert O.precompute_reference(model, enc, batch_size=3, ref_context=counter.ref_context) == 0
    assert counter.ref == 3
    # ... and it really is the adapter-disabled model, which training did not move
    with model.disable_adapter(), torch.no_grad():
        again = O.token_logps(model, batch_all)
    assert torch.allclose(again, batch_all.ref_logps, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- sampler

def roles_list(spec):
    return [type("E", (), {"role": r})() for r, n in spec for _ in range(n)]


def test_sampler_balances_roles_per_batch():
    items = roles_list([("Planner", 10), ("Critic", 3), ("Judger", 2)])
    role = [e.role for e in items]
    s = S.RoleBalancedSampler(items, 6, seed=1)
    for _ in range(20):
        batch = s.next_batch()
        assert len(batch) == 6
        assert sorted(role[i] for i in batch) == sorted(["Critic", "Judger", "Planner"] * 2)
    # 4 = 3 * 1 + 1: the extra slot rotates, so 3 consecutive batches hold 4 of each role
    s = S.RoleBalancedSampler(items, 4, seed=1)
    for _ in range(5):
        got = [role[i] for _ in range(3) for i in s.next_batch()]
        assert all(got.count(r) == 4 for r in ("Planner", "Critic", "Judger"))
    # within a role: without replacement inside an epoch (Planner: 10 examples, 2 per batch)
    s = S.RoleBalancedSampler(items, 6, seed=2)
    planner = [i for _ in range(5) for i in s.next_batch() if role[i] == "Planner"]
    assert sorted(planner) == list(range(10))


def test_sampler_uniform_epochs_when_unbalanced_or_single_role():
    items = roles_list([("A", 7), ("B", 3)])
    for s in (S.RoleBalancedSampler(items, 5, seed=3, balance=False),
              S.RoleBalancedSampler(roles_list([("A", 10)]), 5, seed=3)):
        first, second = s.next_batch() + s.next_batch(), s.next_batch() + s.next_batch()
        assert sorted(first) == sorted(second) == list(range(10)) and first != second


def test_sampler_deterministic_and_resumable():
    items = roles_list([("Planner", 9), ("Critic", 4), ("Refiner", 5)])
    a, b = S.RoleBalancedSampler(items, 5, seed=7), S.RoleBalancedSampler(items, 5, seed=7)
    assert [a.next_batch() for _ in range(10)] == [b.next_batch() for _ in range(10)]
    c = S.RoleBalancedSampler(items, 5, seed=8)
    assert [c.next_batch() for _ in range(10)] != [S.RoleBalancedSampler(items, 5, seed=7)
                                                   .next_batch() for _ in range(10)]
    state = json.loads(json.dumps(a.state_dict()))      # JSON-safe
    tail = [a.next_batch() for _ in range(15)]
    resumed = S.RoleBalancedSampler(items, 5, seed=7)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(15)] == tail
    assert resumed.batches_drawn == 25
    with pytest.raises(ValueError, match="same examples, batch_size, seed"):
        S.RoleBalancedSampler(items, 4, seed=7).load_state_dict(state)
    with pytest.raises(ValueError, match="same examples"):
        S.RoleBalancedSampler(items[1:], 5, seed=7).load_state_dict(state)
