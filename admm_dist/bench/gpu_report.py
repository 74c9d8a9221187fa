"""The GPU check's figures and table: what :mod:`admm_dist.bench.gpu_check`'s steps wrote, read back.

:func:`figures` reads each finished step's own output (``xstep.json``, the training reports
``train/train_<backend>-train.json``, ``collect.json``) into a few named figures;
:func:`format_report` turns the check's report into a short markdown table: one line per step
(status, seconds, limit, the figures or the error), then the x-step rows, the runs and the
collection rows.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence


def _read(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _round(x: Any, nd: int = 4) -> Any:
    return round(x, nd) if isinstance(x, float) else x


def xstep_figures(r: Dict[str, Any]) -> Dict[str, Any]:
    sz = r["sizes"]
    rows = []
    for key, label in (("ours", "ours (Trainer.xstep)"), ("trl", "TRL DPOTrainer"),
                       ("trl_precompute", "TRL precompute_ref_log_probs")):
        s = r.get(f"{key}_s")
        if s is None:
            continue
        rows.append({"row": label, "s_per_step": _round(s),
                     "over_ours": 1.0 if key == "ours" else _round(r.get(f"{key}_over_ours"), 3),
                     "over_ours_paired": (1.0 if key == "ours"
                                          else _round(r.get(f"{key}_over_ours_paired"), 3)),
                     "peak_gib": _round(r.get(f"{key}_peak_gib"), 2)})
    return {"shape": sz["shape"], "device": r.get("device"), "device_name": r.get("device_name"),
            "dtype": r.get("dtype"), "batch": sz["batch"],
            "tokens": [sz["prompt_tokens"], sz["target_tokens"], sz["target_tokens"]],
            "steps": sz["steps"], "warmup": sz["warmup"], "trl": r.get("trl"), "rows": rows,
            "trl_skipped": r.get("trl_skipped")}


def plan_figures(r: Dict[str, Any]) -> Dict[str, Any]:
    """The rehearsal's verdict and its rank's predicted peak and memory by category (bytes)."""
    rank = r["plans"][0]
    return {"fits": r["fits"], "peak_bytes": rank["peak"], "peak_gib": round(rank["peak"] / (1 << 30), 3),
            "memory_bytes": rank["memory"], "seconds": rank["seconds"]}


def train_figures(r: Dict[str, Any]) -> Dict[str, Any]:
    cfg = r.get("config", {})
    coll = (r.get("collections") or [{}])[0]
    return {"generation_backend": cfg.get("generation_backend"),
            "model": os.path.basename(str(cfg.get("model_name"))),
            "nodes": r.get("n_nodes"), "rounds": len(r.get("rounds") or []), "examples": coll.get("examples"),
            "collect_s": coll.get("seconds"), "run_s": _round(r.get("train_sec"), 2),
            "delta_w_rel": _round(r.get("delta_w_rel"), 6), "backend": r.get("backend")}


def collect_figures(r: Dict[str, Any]) -> Dict[str, Any]:
    return {"device": r.get("device"), "vllm": r.get("vllm"),
            "rows": [{k: x.get(k)
                      for k in ("model", "backend", "start_s", "collect_s", "tok_per_s", "over_hf")}
                     | {"tokens": x["tokens"][0] if x.get("tokens") else None} for x in r.get("rows", [])]}


def figures(out: str, steps: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Each finished step's figures (a step whose output cannot be read gets none)."""
    status = {s["name"]: s["status"] for s in steps}
    got: Dict[str, Any] = {}
    if status.get("plan") == "ok" and (r := _read(os.path.join(out, "plan.json"))):
        got["plan"] = plan_figures(r)
    if status.get("xstep") == "ok" and (r := _read(os.path.join(out, "xstep.json"))):
        got["xstep"] = xstep_figures(r)
    for backend in ("hf", "vllm"):
        name = f"train_{backend}"
        if status.get(name) == "ok" and (r := _read(os.path.join(out, "train", f"{name}-train.json"))):
            got[name] = train_figures(r)
    if status.get("collect") == "ok" and (r := _read(os.path.join(out, "collect.json"))):
        got["collect"] = collect_figures(r)
    return got


def _summary(name: str, f: Optional[Dict[str, Any]]) -> str:
    """One cell of a step's key figures."""
    if not f:
        return ""
    if name == "xstep":
        return "; ".join(f"{x['row'].split(' (')[0]} {x['s_per_step']:.4f} s/step"
                         + ("" if x["over_ours_paired"] == 1.0 else f" ({x['over_ours_paired']:.2f}x paired)")
                         for x in f["rows"])
    if name == "plan":
        return (f"predicted peak {f['peak_bytes'] / (1 << 20):.1f} MiB "
                f"({'fits' if f['fits'] else 'does not fit'})")
    if name.startswith("train_"):
        return (f"{f['examples']} examples, {f['nodes']} nodes x {f['rounds']} rounds, "
                f"delta_w_rel {f['delta_w_rel']}")
    if name == "collect":
        return "; ".join(f"{x['backend']} {x['tok_per_s']} tok/s" for x in f["rows"])
    return ""


def format_report(rep: Dict[str, Any]) -> str:
    fig = rep.get("figures", {})
    xs = fig.get("xstep")
    where = (xs or {}).get("device_name") or rep["device"]
    lines: List[str] = [f"## GPU check ({rep['mode']}, {rep['date']}, {where}; torch {rep.get('torch')}, "
                        f"trl {rep.get('trl') or 'not installed'}, vllm "
                        f"{rep.get('vllm') or 'not installed'})", "",
                        "| step | status | seconds | limit s | figures or error |",
                        "| --- | --- | --- | --- | --- |"]
    for s in rep["steps"]:
        cell = s.get("error") or _summary(s["name"], fig.get(s["name"]))
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']} | {s.get('limit_s') or ''} | {cell} |")
    if xs:
        lines += ["", f"x-step on {xs['shape']} ({xs['dtype']}, batch {xs['batch']} pairs of "
                      f"{'+'.join(map(str, xs['tokens']))} tokens, {xs['warmup']} warm-up + {xs['steps']} "
                      f"timed steps in rotation):", "",
                  "| row | s/step | / ours | paired | peak GiB |", "| --- | --- | --- | --- | --- |"]
        for x in xs["rows"]:
            peak = "" if x["peak_gib"] is None else f"{x['peak_gib']:.2f}"
            lines.append(f"| {x['row']} | {x['s_per_step']:.4f} | {x['over_ours']:.2f} | "
                         f"{x['over_ours_paired']:.2f} | {peak} |")
        pl, ours = fig.get("plan"), xs["rows"][0]["peak_gib"] if xs["rows"] else None
        if pl and ours is not None:
            lines += ["", f"memory: rehearsed {pl['peak_gib']:.2f} GiB before the run, measured "
                          f"{ours:.2f} GiB (ours): {pl['peak_gib'] / ours:.2f}x"]
    runs = [(b, fig[f"train_{b}"]) for b in ("hf", "vllm") if f"train_{b}" in fig]
    if runs:
        lines += ["", "single-process run (backend local, 4 seats, one device):", "",
                  "| generation | model | examples | collect s | run s (load to outputs) | rounds | "
                  "delta_w_rel |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {b} | {f['model']} | {f['examples']} | {f['collect_s']} | {f['run_s']} | {f['rounds']} "
                  f"| {f['delta_w_rel']} |" for b, f in runs]
    if fig.get("collect"):
        lines += ["", "collection:", "", "| model | backend | start s | collect s | tokens | tok/s | / hf |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {x['model']} | {x['backend']} | {x['start_s']} | {x['collect_s']} | {x['tokens']} | "
                  f"{x['tok_per_s']} | {'' if x['over_hf'] is None else x['over_hf']} |"
                  for x in fig["collect"]["rows"]]
    lines += ["", f"wall {rep['wall_s']} s of a {rep['budget_s']:.0f} s budget"]
    return "\n".join(lines)
