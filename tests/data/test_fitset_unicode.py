"""A fit-set line whose JSON holds a lone surrogate escape (``\\ud800``) is refused when the file
loads, naming the file and the line (issue 21), instead of a UnicodeEncodeError traceback where
the text is later tokenized or hashed. A surrogate pair (an emoji written as two escapes) and an
escaped backslash followed by ``ud800`` are valid text and still load."""
import pytest

from admm_dist.data.fitset import Example, FitSetError, content_key, load_fitset, save_fitset

SETTINGS = {"task": "chain_arith", "n_agents": 4, "adapt_roles": "all"}


def write(path, target_json: str, line: int = 3) -> None:
    """A valid three-example sft fit set whose example on ``line`` has ``target_json`` (raw JSON
    text of a string) as its target."""
    exs = [Example(seat=0, role="Planner", anchor=f"q{i}", prompt="p", target="TARGET") for i in range(3)]
    save_fitset(str(path), exs, fit_mode="sft", settings=SETTINGS)
    lines = path.read_text(encoding="utf-8").splitlines()
    lines[line - 1] = lines[line - 1].replace('"TARGET"', target_json)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.mark.parametrize("target_json", [r'"ok \ud800 here"', r'"\uDFFF"', r'"\ude00\ud83d"'])
def test_a_lone_surrogate_is_refused_naming_file_and_line(tmp_path, target_json):
    path = tmp_path / "fs.jsonl"
    write(path, target_json)
    with pytest.raises(FitSetError) as info:
        load_fitset(str(path))
    assert str(info.value) == (f"{path}: line 3 holds text that is not valid Unicode (a lone surrogate "
                               "escape such as \\ud800): the file is corrupt; rebuild it")


def test_a_lone_surrogate_in_the_header_is_refused_on_line_1(tmp_path):
    path = tmp_path / "fs.jsonl"
    write(path, '"fine"')
    text = path.read_text(encoding="utf-8").replace('"adapt_roles": "all"', r'"adapt_roles": "a\ud800"', 1)
    path.write_text(text, encoding="utf-8")
    with pytest.raises(FitSetError, match=r"fs.jsonl: line 1 holds text that is not valid Unicode"):
        load_fitset(str(path))


def test_valid_escapes_still_load(tmp_path):
    path = tmp_path / "fs.jsonl"
    write(path, r'"smile \ud83d\ude00 and a path C:\\ud800"')
    f = load_fitset(str(path))
    assert f.examples[1].target == "smile \U0001F600 and a path C:\\ud800"
    assert len(content_key(f)) == 64   # hashes without an encode error
