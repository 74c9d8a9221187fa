"""Format and content, counted apart, in evaluation trajectories (``python -m admm_dist.evaluate
... --save_trajectories T.jsonl``): does training teach a chain to answer, or to answer right?

For each file (one chain per evaluation row, the same rows in every file), over the rows:

- **turn ends**: the share of each seat's messages that ended with the model's end-of-turn
  token instead of being cut by the budget (``finished``), and of the last seat's alone;
- **answer stated**: the share of final answers the task's scorer could read a prediction from;
- **right**: the accuracy (``correct``), and the accuracy among the rows whose answer was stated
  (what is left of a gain once stating an answer is accounted for).

The first file is the baseline: each other file's differences from it are paired per row::

    python -m benchmarks.trajectories untrained.jsonl rsft.jsonl grpo.jsonl [--names a,b,c]

prints one markdown row per file.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Sequence


def read(path: str) -> Dict[int, dict]:
    """The chains of a trajectory file by evaluation row (its ``anchor``)."""
    rows: Dict[int, dict] = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                rec = json.loads(line)
                rows[rec["anchor"]] = rec
    return rows


def measures(chains: Sequence[dict]) -> Dict[str, float]:
    """The shares above over ``chains`` (each a trajectory record)."""
    n = len(chains)
    seats = len(chains[0]["messages"]) if n else 0
    stated = [c for c in chains if c.get("prediction") is not None]
    return {
        "rows": n,
        "turn_ends": sum(m["finished"] for c in chains for m in c["messages"]) / max(1, n * seats),
        "last_seat_ends": sum(c["messages"][-1]["finished"] for c in chains) / max(1, n),
        "stated": len(stated) / max(1, n),
        "right": sum(bool(c["correct"]) for c in chains) / max(1, n),
        "right_if_stated": sum(bool(c["correct"]) for c in stated) / max(1, len(stated)),
    }


def compare(files: Sequence[Dict[int, dict]], names: Sequence[str]) -> List[Dict[str, float]]:
    """:func:`measures` of each file on the rows every file holds, beside its difference from the
    first file's."""
    common = sorted(set.intersection(*(set(f) for f in files)))
    if not common:
        raise ValueError("the files share no evaluation row: compare evaluations of the same rows")
    out = []
    for name, f in zip(names, files):
        m = measures([f[a] for a in common])
        out.append({"name": name, **m})
    base = out[0]
    for row in out:
        row.update({f"d_{k}": row[k] - base[k] for k in ("turn_ends", "last_seat_ends", "stated", "right",
                                                        "right_if_stated")})
    return out


def table(rows: Sequence[Dict[str, float]]) -> str:
    pts = lambda v: f"{100 * v:.1f}"   # noqa: E731
    delta = lambda v: f"{100 * v:+.1f}"   # noqa: E731
    lines = ["| chain | rows | turn ends (all seats) | last seat ends | answer stated | right "
             "| right when stated |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for i, r in enumerate(rows):
        cells = [f"{pts(r[k])}" + ("" if i == 0 else f" ({delta(r['d_' + k])})")
                 for k in ("turn_ends", "last_seat_ends", "stated", "right", "right_if_stated")]
        lines.append(f"| {r['name']} | {r['rows']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="trajectory files of the same evaluation rows; the first is "
                    "the baseline")
    ap.add_argument("--names", default=None, help="comma-separated names of the files (default: the paths)")
    args = ap.parse_args(argv)
    names = args.names.split(",") if args.names else list(args.files)
    if len(names) != len(args.files):
        ap.error(f"--names gives {len(names)} names for {len(args.files)} files")
    try:
        rows = compare([read(p) for p in args.files], names)
    except (OSError, ValueError, KeyError) as e:
        print(f"benchmarks.trajectories: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
