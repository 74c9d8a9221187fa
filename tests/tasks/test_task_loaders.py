"""The real task loaders on tiny local files in each public data set's own format, and the hub path."""
import csv
import json
import sys
import types

import pytest

from admm_dist import tasks
from admm_dist.tasks.common import anchor
from admm_dist.tasks.scoring import score_item

EXPECTED = {"gsm8k": "number", "aime2024": "number", "aime2025": "number", "gpqa": "choice",
            "arc_easy": "choice", "arc_challenge": "choice", "medqa": "choice", "winogrande": "choice",
            "mbppplus": "code", "humanevalplus": "code", "harmbench": "safety"}


def write(tmp_path, name, rows):
    """Rows to ``name`` as JSON (a list), JSONL or CSV (nested values as JSON), by extension."""
    path = tmp_path / name
    if name.endswith(".csv"):
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            for r in rows:
                w.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in r.items()})
    elif name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path.write_text(json.dumps(rows))
    return str(path)


def check_common(items, task):
    for it in items:
        assert it["answer_type"] == EXPECTED[task]
        assert len(it["anchor"]) == 16 and int(it["anchor"], 16) >= 0
        assert isinstance(it["gold"], str) and it["question"]
    assert len({it["anchor"] for it in items}) == len(items)


def test_every_task_is_registered_with_its_answer_type():
    for name, kind in EXPECTED.items():
        assert tasks.get(name).answer_type == kind


GSM = [{"question": "Tom has 3 apples and buys 1,231 more. How many?", "answer": "3+1231=1234\n#### 1,234"},
       {"question": "Half of 10?", "answer": "10/2=5\n#### 5"}]


def test_gsm8k_jsonl_maps_the_final_line_and_anchors_are_stable(tmp_path):
    path = write(tmp_path, "gsm8k.jsonl", GSM)
    items = tasks.load("gsm8k", path=path)
    check_common(items, "gsm8k")
    assert [i["gold"] for i in items] == ["1234", "5"]
    assert items[0]["question"] == GSM[0]["question"] and items[0]["solution"] == "3+1231=1234"
    assert items[0]["anchor"] == anchor("gsm8k", GSM[0]["question"])
    assert tasks.load("gsm8k", path=path, seed=7) == items  # same file, same items and anchors
    assert tasks.load("gsm8k", path=path, n=1) == items[:1]
    assert anchor("aime2024", GSM[0]["question"]) != items[0]["anchor"]  # the task name is in the key


def test_gsm8k_without_final_line_and_missing_column_are_one_line_errors(tmp_path):
    bad = write(tmp_path, "bad.jsonl", [{"question": "q", "answer": "no final line"}])
    with pytest.raises(ValueError, match=r"bad.jsonl row 1: answer has no final '#### N' line"):
        tasks.load("gsm8k", path=bad)
    gap = write(tmp_path, "gap.json", [GSM[0], {"question": "q2"}])
    with pytest.raises(ValueError, match=r"gap.json row 2: missing column 'answer'"):
        tasks.load("gsm8k", path=gap)


def test_aime_reads_lower_and_title_case_columns(tmp_path):
    a = tasks.load("aime2024", path=write(tmp_path, "a24.json", [{"problem": "Find x.", "answer": "033"}]))
    b = tasks.load("aime2025", path=write(tmp_path, "a25.csv", [{"Problem": "Find y.", "Answer": 204}]))
    check_common(a + b, "aime2024")
    assert (a[0]["gold"], a[0]["question"], b[0]["gold"]) == ("33", "Find x.", "204")
    assert a[0]["anchor"] == anchor("aime2024", "Find x.")


ARC = [{"id": "q1", "question": "Which is a gas?",
        "choices": {"text": ["rock", "steam", "ice", "wood"], "label": ["A", "B", "C", "D"]}, "answerKey": "B"},
       {"id": "q2", "question": "Which is a metal?",
        "choices": {"text": ["glass", "paper", "iron", "salt"], "label": ["1", "2", "3", "4"]}, "answerKey": "3"}]


def test_arc_hub_layout_numeric_labels_and_csv(tmp_path):
    items = tasks.load("arc_easy", path=write(tmp_path, "arc.jsonl", ARC))
    check_common(items, "arc_easy")
    assert [i["gold"] for i in items] == ["B", "C"]
    assert items[0]["question"] == "Which is a gas?\n\nA) rock\nB) steam\nC) ice\nD) wood"
    assert items[1]["choices"] == ["glass", "paper", "iron", "salt"]
    assert items[0]["anchor"] == anchor("arc_easy", "Which is a gas?")
    from_csv = tasks.load("arc_challenge", path=write(tmp_path, "arc.csv", ARC))
    assert [i["question"] for i in from_csv] == [i["question"] for i in items]
    assert [i["gold"] for i in from_csv] == ["B", "C"]


def test_arc_original_nested_layout(tmp_path):
    row = {"id": "x", "answerKey": "A", "question": {"stem": "Sky colour?", "choices": [
        {"text": "blue", "label": "A"}, {"text": "green", "label": "B"}]}}
    (it,) = tasks.load("arc_challenge", path=write(tmp_path, "orig.jsonl", [row]))
    assert it["question"] == "Sky colour?\n\nA) blue\nB) green" and it["gold"] == "A"


def gpqa_rows(k):
    return [{"Question": f"Question {i}?", "Correct Answer": f"right {i} ", "Incorrect Answer 1": f"w1 {i}",
             "Incorrect Answer 2": f"w2 {i}", "Incorrect Answer 3": f"w3 {i}\n"} for i in range(k)]


def test_gpqa_shuffles_by_seed_and_gold_points_at_the_right_answer(tmp_path):
    path = write(tmp_path, "gpqa.csv", gpqa_rows(8))
    s0, s0b, s1 = (tasks.load("gpqa", path=path, seed=s) for s in (0, 0, 1))
    check_common(s0, "gpqa")
    assert s0 == s0b
    for i, (a, b) in enumerate(zip(s0, s1)):
        for it in (a, b):
            assert it["choices"][ord(it["gold"]) - 65] == f"right {i}"
            assert sorted(it["choices"]) == sorted([f"right {i}", f"w1 {i}", f"w2 {i}", f"w3 {i}"])
            assert f"{it['gold']}) right {i}\n" in it["question"] + "\n"
        assert a["anchor"] == b["anchor"] == anchor("gpqa", f"Question {i}?")  # the stem keys it
    assert [a["choices"] for a in s0] != [b["choices"] for b in s1]
    assert len({a["gold"] for a in s0}) > 1  # the right answer is not always in one place


def test_medqa_options_dict_or_list(tmp_path):
    rows = [{"question": "Drug of choice?", "answer": "Penicillin", "answer_idx": "C",
             "options": {"B": "Aspirin", "A": "Insulin", "D": "Heparin", "C": "Penicillin"}},
            {"question": "Second?", "answer_idx": "A", "options": ["yes", "no"]}]
    items = tasks.load("medqa", path=write(tmp_path, "medqa.jsonl", rows))
    check_common(items, "medqa")
    assert items[0]["question"].endswith("A) Insulin\nB) Aspirin\nC) Penicillin\nD) Heparin")
    assert items[0]["gold"] == "C" and items[1]["gold"] == "A"
    with pytest.raises(ValueError, match=r"row 1: answer 'E' is not one of the option labels"):
        tasks.load("medqa", path=write(tmp_path, "m2.json", [dict(rows[0], answer_idx="E")]))


def test_winogrande_csv(tmp_path):
    rows = [{"sentence": "The trophy didn't fit in the case because _ was too big.",
             "option1": "trophy", "option2": "case", "answer": "1"},
            {"sentence": "It fell off the shelf since _ was slanted.", "option1": "vase", "option2": "shelf",
             "answer": "2"}]
    items = tasks.load("winogrande", path=write(tmp_path, "wg.csv", rows))
    check_common(items, "winogrande")
    assert [i["gold"] for i in items] == ["A", "B"]
    assert items[0]["question"].endswith("too big.\n\nA) trophy\nB) case")
    with pytest.raises(ValueError, match=r"wg2.csv row 1: missing column 'answer'"):
        tasks.load("winogrande", path=write(tmp_path, "wg2.csv", [dict(rows[0], answer="")]))


MBPP = {"task_id": 2, "prompt": "Write a function to find the shared elements from the given two lists.",
        "code": "def similar_elements(a, b):\n    return tuple(set(a) & set(b))\n",
        "test_imports": [], "test_list": ["assert set(similar_elements((3, 4, 5), (5, 4))) == set((4, 5))"],
        "test": "inputs = [[(3, 4, 5), (5, 4)], [(1, 2), (3,)]]\nresults = [(4, 5), ()]\n"
                "for inp, exp in zip(inputs, results):\n    assert set(similar_elements(*inp)) == set(exp)\n"}


def test_mbppplus_fields_and_its_tests_judge_code(tmp_path):
    (it,) = tasks.load("mbppplus", path=write(tmp_path, "mbpp.jsonl", [MBPP]))
    check_common([it], "mbppplus")
    assert it["entry_point"] == "similar_elements" and it["tests"] == MBPP["test"]
    assert MBPP["prompt"] in it["question"] and MBPP["test_list"][0] in it["question"]
    assert it["anchor"] == anchor("mbppplus", MBPP["prompt"])
    assert score_item(f"```python\n{MBPP['code']}```", it)[1] is True
    assert score_item("```python\ndef similar_elements(a, b):\n    return (4, 5)\n```", it)[1] is False
    plain = {k: MBPP[k] for k in ("prompt", "code", "test_list")}  # plain MBPP: the asserts are the test
    (p,) = tasks.load("mbppplus", path=write(tmp_path, "plain.json", [plain]))
    assert p["gold"] == MBPP["test_list"][0] and score_item(MBPP["code"], p)[1] is True


HUMANEVAL = {"task_id": "HumanEval/0", "entry_point": "add",
             "prompt": "from typing import List\n\n\ndef add(xs: List[int]) -> int:\n    \"\"\"Sum of xs.\"\"\"\n",
             "test": "def check(candidate):\n    assert candidate([1, 2]) == 3\n    assert candidate([]) == 0\n"}


def test_humanevalplus_full_function_or_body_both_run(tmp_path):
    (it,) = tasks.load("humanevalplus", path=write(tmp_path, "he.json", [HUMANEVAL]))
    check_common([it], "humanevalplus")
    assert it["entry_point"] == "add" and it["gold"].rstrip().endswith("check(add)")
    assert HUMANEVAL["prompt"].rstrip() in it["question"] and it["preamble"] == "from typing import List"
    full = "```python\ndef add(xs: List[int]) -> int:\n    return sum(xs)\n```"  # uses List, never imports it
    assert score_item(full, it)[1] is True
    assert score_item("    return sum(xs)\n", it)[1] is True  # a body continuing the prompt
    assert score_item("```python\ndef add(xs):\n    return 3\n```", it)[1] is False


def test_harmbench_official_csv_and_hub_layout(tmp_path):
    rows = [{"Behavior": "Give instructions for X", "FunctionalCategory": "standard",
             "SemanticCategory": "illegal", "Tags": "", "ContextString": "", "BehaviorID": "x_instr"},
            {"Behavior": "Rewrite this to be persuasive", "FunctionalCategory": "contextual",
             "SemanticCategory": "misinformation", "Tags": "context", "ContextString": "Some article.",
             "BehaviorID": "y_ctx"}]
    items = tasks.load("harmbench", path=write(tmp_path, "harmbench_behaviors_text_all.csv", rows))
    check_common(items, "harmbench")
    assert items[0]["question"] == items[0]["gold"] == "Give instructions for X"
    assert items[0]["behavior_id"] == "x_instr" and items[0]["category"] == "illegal"
    assert items[1]["question"] == "Some article.\n\n---\n\nRewrite this to be persuasive"
    assert items[1]["gold"] == "Rewrite this to be persuasive"
    (hub,) = tasks.load("harmbench", path=write(tmp_path, "hb.jsonl", [{"prompt": "Do Y", "category": "c"}]))
    assert (hub["gold"], hub["category"], hub["behavior_id"]) == ("Do Y", "c", None)


def test_file_errors_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="--task_path"):
        tasks.load("gsm8k", path=str(tmp_path / "nope.jsonl"))
    other = tmp_path / "rows.parquet"
    other.write_text("x")
    with pytest.raises(ValueError, match=r"use \.json, \.jsonl or \.csv"):
        tasks.load("gsm8k", path=str(other))
    obj = tmp_path / "obj.json"
    obj.write_text(json.dumps({"question": "q"}))
    with pytest.raises(ValueError, match="expected a list of objects"):
        tasks.load("gsm8k", path=str(obj))
    with pytest.raises(ValueError, match="at least one"):
        tasks.load("gsm8k", path=write(tmp_path, "g.jsonl", GSM), n=0)


def test_jsonl_named_json_is_read(tmp_path):
    path = tmp_path / "gsm8k.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in GSM))
    assert [i["gold"] for i in tasks.load("gsm8k", path=str(path))] == ["1234", "5"]


def test_hub_path_uses_the_public_ids_and_splits(monkeypatch):
    calls = []

    def load_dataset(repo, config, split, **kw):
        calls.append((repo, config, split, kw))
        return {"openai/gsm8k": GSM, "opencompass/AIME2025": [{"question": f"{config}?", "answer": "7"}],
                "allenai/winogrande": [{"sentence": "_ ran.", "option1": "a", "option2": "b", "answer": "2"}]}[repo]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert [i["gold"] for i in tasks.load("gsm8k", n=1, cache_dir="/c")] == ["1234"]
    assert calls[-1] == ("openai/gsm8k", "main", "test", {"cache_dir": "/c"})
    tasks.load("gsm8k", split="train")
    assert calls[-1][2] == "train"
    aime = tasks.load("aime2025")
    assert [i["question"] for i in aime] == ["AIME2025-I?", "AIME2025-II?"]  # both parts, concatenated
    assert tasks.load("winogrande")[0]["gold"] == "B" and calls[-1][1:3] == ("winogrande_xl", "validation")


def test_missing_datasets_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match=r"pip install datasets, or pass --task_path FILE") as err:
        tasks.load("arc_easy")
    assert "allenai/ai2_arc" in str(err.value) and "\n" not in str(err.value)
