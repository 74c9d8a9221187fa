"""Format and content counted apart in trajectory files (benchmarks/trajectories.py), on files
written as the evaluation writes them."""
import json

import pytest

from benchmarks import trajectories as T


def _chain(anchor, finished, prediction, correct):
    return {"anchor": anchor, "messages": [{"seat": s, "finished": f} for s, f in enumerate(finished)],
            "prediction": prediction, "correct": correct}


def _write(path, chains):
    path.write_text("\n".join(json.dumps(c) for c in chains) + "\n")
    return str(path)


def test_format_and_content_are_counted_apart_on_the_shared_rows(tmp_path, capsys):
    base = _write(tmp_path / "a.jsonl", [_chain(0, [True, False], None, False), _chain(1, [True, False], "3", False),
                                         _chain(2, [True, True], "5", True), _chain(9, [True, True], "1", True)])
    # trained: every turn ends and every answer is stated; one more row right, on rows 0-2 only
    trained = _write(tmp_path / "b.jsonl", [_chain(0, [True, True], "4", True), _chain(1, [True, True], "2", False),
                                            _chain(2, [True, True], "5", True)])
    rows = T.compare([T.read(base), T.read(trained)], ["untrained", "trained"])
    a, b = rows
    assert a["rows"] == b["rows"] == 3                      # row 9 is not in both
    assert (a["turn_ends"], b["turn_ends"], b["d_last_seat_ends"]) == pytest.approx((4 / 6, 1.0, 2 / 3))
    assert (a["stated"], b["stated"], b["d_right"]) == pytest.approx((2 / 3, 1.0, 1 / 3))
    assert (a["right_if_stated"], b["right_if_stated"]) == pytest.approx((1 / 2, 2 / 3))
    assert T.main([base, trained, "--names", "untrained,trained"]) == 0
    out = capsys.readouterr().out
    assert "| trained | 3 | 100.0 (+33.3) | 100.0 (+66.7) | 100.0 (+33.3) | 66.7 (+33.3) | 66.7 (+16.7) |" in out


def test_files_without_a_shared_row_or_a_missing_file_are_one_line(tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", [_chain(0, [True], "1", True)])
    b = _write(tmp_path / "b.jsonl", [_chain(1, [True], "1", True)])
    assert T.main([a, b]) == 2
    assert T.main([a, str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "share no evaluation row" in err[0] and "none.jsonl" in err[1]
