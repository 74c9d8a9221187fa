"""Prompt modes: who sees which upstream message, the hardened fences, clipping and errors."""
import pytest

from admm_dist.mas import prompts as P

HIST = ["plan: add them", "critique: fine", "refined: 7"]


def test_visibility_per_mode():
    assert P.visible_upstream("sequential", 2, 4) == [1]
    assert P.visible_upstream("sequential_v2", 3, 4) == [0, 1, 2]
    assert P.visible_upstream("hierarchical", 2, 4) == []        # workers are independent
    assert P.visible_upstream("hierarchical", 3, 4) == [0, 1, 2]  # the judger sees them all
    assert P.visible_upstream("sequential_v2s", 0, 4) == []
    assert set(P.prompt_modes()) >= {"sequential", "sequential_v2", "hierarchical",
                                     "sequential_v2s", "hierarchical_v2s"}


def test_user_message_carries_exactly_the_visible_messages():
    text = P.user_message("sequential", seat=2, n_agents=4, question="3+4?", history=HIST)
    assert "critique: fine" in text and "plan: add them" not in text
    text = P.user_message("sequential_v2", seat=3, n_agents=4, question="3+4?", history=HIST)
    assert all(h in text for h in HIST) and "Answer: <number>" in text
    assert text.index("[Planner]") < text.index("[Critic]") < text.index("[Refiner]")
    text = P.user_message("hierarchical", seat=1, n_agents=4, question="3+4?", history=HIST)
    assert not any(h in text for h in HIST) and "independent" in text


def test_hardened_modes_fence_upstream_text_and_warn():
    text = P.user_message("sequential_v2s", seat=3, n_agents=4, question="q", history=HIST,
                          answer_type="choice")
    assert "<<<[Planner]: plan: add them>>>" in text and "never follow" in text
    assert "Answer: <letter>" in text


def test_compact_wording_for_the_standin():
    text = P.user_message("sequential_v2", seat=1, n_agents=4, question="Start 3: +4 *2 -1",
                          history=["3+4=7"], words="compact")
    assert text == "Start 3: +4 *2 -1\n3+4=7\nCritic: step 2"


def test_clip_keeps_the_end_of_the_context():
    text = P.user_message("sequential_v2", seat=3, n_agents=4, question="q", history=HIST,
                          clip=lambda s: s[-12:])
    assert "refined: 7" in text and "plan" not in text


@pytest.mark.parametrize("kw,match", [
    (dict(mode="nope"), "choose one of"),
    (dict(seat=4), "outside a chain"),
    (dict(seat=3, history=["a"]), "needs the messages"),
    (dict(words="tiny"), "wording"),
])
def test_bad_input_is_a_clear_error(kw, match):
    args = dict(mode="sequential_v2", seat=1, n_agents=4, question="q", history=HIST)
    args.update(kw)
    mode = args.pop("mode")
    with pytest.raises(ValueError, match=match):
        P.user_message(mode, **args)
