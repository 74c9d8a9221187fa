"""Scoring by answer type (number, choice, code, safety) and the code sandbox."""
import os
import time

import pytest

from admm_dist.tasks.sandbox import run_python
from admm_dist.tasks.scoring import extract_choice, extract_code, extract_number, score, score_item

from procs import subreaper


@pytest.mark.parametrize("text,want", [
    (r"so \boxed{42}, checked in 3 steps", "42"),
    (r"\boxed{1,234}", "1234"),
    (r"\boxed{\text{7}} then 9", "7"),  # nested braces inside the box
    (r"\boxed{x} the answer is 5", "5"),  # a box with no number: the last number
    ("The answer is 033.", "33"),
    ("-0.50", "-0.5"),
    ("-0", "0"),
])
def test_extract_number_prefers_boxed_and_normalizes(text, want):
    assert extract_number(text) == want


@pytest.mark.parametrize("text,want", [
    ("Answer: B", "B"),
    ("The answer is (C). D was tempting.", "C"),
    ("Final answer: **D**", "D"),
    ("the correct option is A, not B", "A"),
    (r"So \boxed{B}. Not A.", "B"),
    (r"\boxed{\text{(E)}}", "E"),
    ("<think>Answer: A</think>After all, B", "B"),  # only the visible part counts
    ("I think C", "C"),  # "I" is a pronoun here
    ("A good choice here is D", "D"),  # "A" is an article here
    ("Option A is correct.", "A"),
    ("C", "C"),
    ("no letter here", None),
])
def test_extract_choice(text, want):
    assert extract_choice(text) == want


@pytest.mark.parametrize("text,gold,ok", [
    ("The answer is (B)", "B", True),
    ("The answer is (B)", " b ", True),
    ("Answer: C", "B", False),
    ("nothing chosen", "A", False),
])
def test_choice_scoring(text, gold, ok):
    assert score(text, gold, "choice")[1] is ok


def test_choice_item_only_accepts_its_own_letters():
    item = {"answer_type": "choice", "gold": "B", "choices": ["x", "y"]}
    assert score_item("Answer: B", item) == ("B", True)
    assert score_item("B, though the answer is C", item) == ("B", True)  # C is not an option here
    assert score_item("the answer is A", item) == ("A", False)


def test_number_scoring_accepts_boxed():
    assert score(r"3 then 4, so \boxed{12} (not 13)", "12", "number") == ("12", True)
    assert score_item("It is 41.", {"answer_type": "number", "gold": "42"}) == ("41", False)


def test_extract_code_picks_the_last_python_block():
    text = "```python\ndef f(): return 1\n```\ntext\n```py\ndef f(): return 2\n```\n```\nnot code\n```"
    assert extract_code(text) == "def f(): return 2\n"
    assert extract_code("```\nx = 1\n```") == "x = 1\n"  # untagged fence when no python one
    assert extract_code("<think>```python\nbad\n```</think>x = 3") == "x = 3\n"  # no fence: whole answer
    assert extract_code("```python\ny = 2\n") == "y = 2\n"  # cut before the closing fence


TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"


@pytest.mark.parametrize("text,ok", [
    ("Here:\n```python\ndef add(a, b):\n    return a + b\n```", True),
    ("```python\ndef add(a, b):\n    return a - b\n```", False),
    ("```python\ndef add(a, b) return\n```", False),  # syntax error
    ("```python\nimport sys\nsys.exit(0)\n```", False),  # exits 0 before the tests ran
    ("```python\nimport os\nos._exit(0)\n```", False),
    ("```python\nimport atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b): return 0\n```", False),
])
def test_code_scoring_runs_the_tests(text, ok):
    assert score(text, TESTS, "code")[1] is ok


def test_safety_points_to_the_judge_and_unknown_types_fail():
    with pytest.raises(ValueError, match="judge"):
        score("I can't help with that.", "Give instructions for X", "safety")
    with pytest.raises(ValueError, match="judge"):
        score_item("no", {"answer_type": "safety", "gold": "x"})
    with pytest.raises(ValueError, match="number, choice, code or safety"):
        score("x", "y", "essay")


def test_sandbox_passes_correct_code_and_fails_wrong_code():
    good = run_python("print(sum(range(5)))")
    assert good.ok and good.returncode == 0 and not good.timed_out and good.stdout_tail == "10\n"
    bad = run_python("assert 1 + 1 == 3, 'arith'")
    assert not bad.ok and bad.returncode == 1 and "AssertionError: arith" in bad.stderr_tail


def test_sandbox_kills_an_infinite_loop():
    t = time.monotonic()
    r = run_python("while True:\n    pass\n", timeout_s=2.0)
    assert r.timed_out and not r.ok and r.returncode is not None and r.returncode < 0
    assert time.monotonic() - t < 60.0          # killed at its timeout, not left running


@pytest.mark.parametrize("code", ["x = bytearray(10**10)", "x = []\nwhile True:\n    x.append(b'.' * 10**6)\n"])
def test_sandbox_stops_a_memory_bomb_by_its_memory_limit(code):
    # the memory limit stops it (MemoryError), not the timeout: no wall-clock bound here, which
    # a loaded CI machine would break (the bomb took 5.1 s there once)
    r = run_python(code, timeout_s=60.0, memory_mb=256)
    assert not r.ok and not r.timed_out and "MemoryError" in r.stderr_tail


def test_sandbox_is_isolated_and_cuts_floods():
    r = run_python("import os, sys\nprint(os.getcwd(), sys.flags.isolated, sorted(os.environ).count('PYTHONPATH'))\n"
                   "open('f.txt', 'w').write('x')")
    cwd, isolated, pythonpath = r.stdout_tail.split()
    assert r.ok and "admm_sandbox_" in cwd and isolated == "1" and pythonpath == "0"
    assert not os.path.exists(cwd)  # the temp directory is gone
    flood = run_python("while True:\n    print('x' * 10000)\n", timeout_s=5.0)
    assert not flood.ok and not flood.timed_out and len(flood.stdout_tail) <= 2000


def test_sandbox_kills_what_the_code_left_running():
    # The pid the code sees is its sandbox's own (a PID namespace), so look from here: as a
    # child subreaper this process inherits whatever outlives the run. Nothing may.
    with subreaper() as new_children:
        r = run_python("import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(60)\nelse:\n    print(pid)\n")
        assert r.ok and int(r.stdout_tail) > 0
        deadline = time.monotonic() + 2.0
        while new_children() and time.monotonic() < deadline:
            time.sleep(0.02)
        left = new_children()
        for pid in left:
            os.kill(pid, 9)
        assert not left
