"""A run's outputs (DESIGN.md section 7): the paths checked before any work, the result files
written at the end, and the training report.

- Before anything loads, :meth:`RunOutputs.check` refuses unwritable paths and a fresh run that
  would mix with another run's files (every rank checks; every rank stops on any problem).
- At the end, :meth:`RunOutputs.write_results` writes ``<out>/node-<i>.safetensors`` (x, z, u
  per node), ``<out>/seat_map.json``, ``<out>/config.yaml``, ``<out>-last.safetensors`` (the
  consensus z), ``<out>-best.safetensors`` (the lowest held-out NLL) and ``<out>-last-peft/``.
- :meth:`RunOutputs.write_report` writes ``<report_dir>/<name>-train.json``; a refused,
  preempted or dry run writes ``<name>-train-<kind>.json`` beside it, never over it.
- :meth:`RunOutputs.open_tracker` opens ``report_to``'s trackers in ``tracking_dir``
  (:mod:`~admm_dist.training.tracking`); a fresh run refuses a folder holding another run's
  TensorBoard events unless ``overwrite=true``, which removes them.
"""
from __future__ import annotations

import functools
import math
import os
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence

import torch
from safetensors.torch import save as st_save

from admm_dist.core.config_file import dump_yaml
from admm_dist.core.errors import UserError
from admm_dist.core.io import atomic_write_bytes, atomic_write_json
from admm_dist.model.vectors import save_vector
from admm_dist.training import checkpoint as ckpt
from admm_dist.training.config import TrainConfig
from admm_dist.training.report import TrainReport
from admm_dist.training.tracking import Tracker, TrackingConfig, collection_scalars, event_files, open_tracker

if TYPE_CHECKING:
    from admm_dist.engine.admm import ADMMEngine
    from admm_dist.engine.comm import Communicator
    from admm_dist.model.adapter import BOnlyLoRA
    from admm_dist.training.state import BestRound


class RefusedError(UserError):
    """The run finished but its result is refused (the adapter did not move, or diverged):
    no result file is written, the report goes to ``<name>-train-refused.json``."""


class RunOutputs:
    """The output paths of one run, seen from one rank."""

    def __init__(self, cfg: TrainConfig, rank: int, talk: Callable[[str], None]):
        self.cfg = cfg
        self.rank = rank
        self.talk = talk

    # ------------------------------------------------------------------ before any work
    def check(self, comm: "Communicator", n_local: int) -> None:
        """Every output path is writable, and a fresh run does not mix with another run's files.

        A fresh run (``resume=never``) into an ``out`` that holds checkpoints or results is
        refused unless ``overwrite=true`` (then the checkpoints go at once and the results when
        this run's replace them); ``resume=auto`` with results but no checkpoints is refused the
        same way.
        """
        cfg = self.cfg
        problem = self.problem()
        table = comm.gather_rows(torch.tensor([[float(problem is not None)]] * n_local, dtype=torch.float64))
        if problem is not None:
            raise UserError(problem)
        if table.max().item() > 0:
            raise UserError("another rank found a problem with the output paths (see its message)")
        if cfg.overwrite and self.rank == 0 and os.path.isdir(ckpt.ckpt_root(cfg.out)):
            ckpt.remove_all(ckpt.ckpt_root(cfg.out))
            self.talk(f"overwrite: removed the checkpoints in {ckpt.ckpt_root(cfg.out)}")
        stale = event_files(self.tracking_folder()) if "tensorboard" in self.tracking.active else []
        if cfg.overwrite and self.rank == 0 and stale:
            for path in stale:
                os.unlink(path)
            self.talk(f"overwrite: removed {len(stale)} TensorBoard event file(s) in {self.tracking_folder()}")
        if cfg.overwrite:
            comm.gather_rows(torch.zeros(n_local, 1, dtype=torch.float64))  # removal seen by all

    def problem(self) -> Optional[str]:
        """What is wrong with this rank's output paths, or None."""
        cfg = self.cfg
        out, root = cfg.out, ckpt.ckpt_root(cfg.out)
        folders = {"out": out, "the checkpoint folder": root, "report_dir": cfg.report_dir,
                   "the folder of out": os.path.dirname(os.path.abspath(out))}
        if self.tracking.active:
            if self.rank == 0 and self.tracking.missing():
                return self.tracking.missing()
            folders["tracking_dir"] = self.tracking_folder()
        for what, folder in folders.items():
            fix = f"{what}=" if what in ("report_dir", "tracking_dir") else "out="
            if os.path.exists(folder) and not os.path.isdir(folder):
                return f"{what} {folder} exists and is not a folder: choose another {fix}"
            here = os.path.abspath(folder)   # nothing is created yet: the nearest existing folder decides
            while not os.path.exists(here):
                here = os.path.dirname(here)
            if not os.path.isdir(here):
                return f"{what} {folder} cannot be created: {here} is a file; choose another {fix}"
            if not os.access(here, os.W_OK | os.X_OK):
                return f"cannot write to {what} {folder} ({here} is read-only or not ours): choose a writable {fix}"
        for path, kind in ((out + "-last.safetensors", "file"), (out + "-best.safetensors", "file"),
                           (out + "-last-peft", "folder")):
            if os.path.exists(path) and (os.path.isdir(path) != (kind == "folder")):
                return f"{path} exists and is not a {kind}: move it away or choose another out="
        if cfg.dry_run or cfg.overwrite:
            return None
        rounds = ckpt.all_rounds(root)
        results = [p for p in (out + "-last.safetensors", os.path.join(out, "seat_map.json"))
                   if os.path.exists(p)]
        if cfg.resume == "never" and (rounds or results):
            held = f"checkpoints up to round {rounds[-1]}" if rounds else f"the results {results[0]}"
            return (f"out={out} already holds a run ({held}): continue it with resume=auto, replace it "
                    "with overwrite=true, or choose a new out=")
        if cfg.resume == "auto" and results and not rounds:
            return (f"out={out} holds the results of a finished run ({results[0]}) and no checkpoints to "
                    "resume: replace it with overwrite=true, or choose a new out=")
        if cfg.resume == "never" and "tensorboard" in self.tracking.active and event_files(self.tracking_folder()):
            return (f"tracking_dir {self.tracking_folder()} holds another run's TensorBoard events: replace "
                    "them with overwrite=true, or choose a new out= or tracking_dir=")
        return None

    # ------------------------------------------------------------------ tracking
    @functools.cached_property
    def tracking(self) -> TrackingConfig:
        """``report_to``'s settings, built once (the config is frozen)."""
        return self.cfg.tracking_config()

    def tracking_folder(self) -> str:
        return self.tracking.folder(self.cfg.report_dir, os.path.basename(self.cfg.out))

    def open_tracker(self, comm: "Communicator", n_local: int, fingerprint: str, resumed_after: int,
                     report: TrainReport) -> Tracker:
        """This rank's trackers (rank 0 writes); a fresh run logs the collections made so far.
        Every rank stops if rank 0 could not open them (no rank is left waiting in a round)."""
        cfg = self.cfg
        name = os.path.basename(cfg.out)
        run_id = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:40] + "-" + fingerprint
        failed: Optional[BaseException] = None
        try:
            tracker = open_tracker(self.tracking, rank=self.rank, folder=self.tracking_folder(),
                                   name=name, config=cfg.as_dict(), config_yaml=dump_yaml(cfg), run_id=run_id,
                                   resumed_after=resumed_after)
        except Exception as exc:    # a library's own error included: the other ranks must hear of it
            failed, tracker = exc, Tracker()
        table = comm.gather_rows(torch.tensor([[float(failed is not None)]] * n_local, dtype=torch.float64))
        if failed is not None:
            raise failed
        if table.max().item() > 0:
            raise UserError("rank 0 could not open the trackers of report_to (see its message)")
        if tracker.active:
            self.talk(f"tracking ({', '.join(self.tracking.active)}) in {self.tracking_folder()}")
            for stats in (report.get("collections") or [] if not resumed_after else []):
                tracker.log(stats["collection"] * cfg.recollect_every, collection_scalars(stats))
        return tracker

    # ------------------------------------------------------------------ at the end
    def write_results(self, *, engine: "ADMMEngine", comm: "Communicator", nodes: Sequence[int],
                      adapter: "BOnlyLoRA", report: TrainReport, best: Optional["BestRound"],
                      deploy_local: bool) -> None:
        cfg = self.cfg
        meta = {"config": cfg.as_dict(), "seats": cfg.adapted_seats(),
                "roles": [cfg.role(s) for s in cfg.adapted_seats()],
                "n_nodes": comm.n_nodes}
        for j, node in enumerate(nodes):
            path = os.path.join(cfg.out, f"node-{node}.safetensors")
            atomic_write_bytes(path, st_save({k: v.detach().cpu().contiguous() for k, v in
                                              (("x", engine.x[j]), ("z", engine.z[j]), ("u", engine.u[j]))}))
        if self.rank != 0:
            return
        for stale in (k for k in self.node_files() if k >= comm.n_nodes):   # an overwritten run's extras
            os.unlink(os.path.join(cfg.out, f"node-{stale}.safetensors"))
        anchor_keys = list(report.get("anchor_keys") or [])
        atomic_write_json(os.path.join(cfg.out, "seat_map.json"),
                          dict(meta, deploy_required="local" if deploy_local else None,
                               anchor_keys=anchor_keys,
                               node_of_seat={str(s): (0 if cfg.pooled else i)
                                             for i, s in enumerate(cfg.adapted_seats())}))
        atomic_write_bytes(os.path.join(cfg.out, "config.yaml"), dump_yaml(cfg).encode())
        if cfg.local_only:
            self.talk(f"wrote {cfg.out}/ (local-only: deploy each node's x_i per seat)")
            return
        z = engine.z[0]
        # A copied adapter keeps the leakage check: it carries the training queries' keys.
        trained_on = {"anchor_keys": anchor_keys, "report": os.path.abspath(self.report_path())}
        save_vector(cfg.out + "-last.safetensors", z,
                    {"selection": "final consensus variable z", "round": engine.round,
                     "deploy_required": "local" if deploy_local else None, **trained_on}, adapter=adapter)
        self.talk(f"wrote {cfg.out}-last.safetensors")
        if best is not None:
            save_vector(cfg.out + "-best.safetensors", best.z,
                        {"selection": "lowest held-out NLL", "round": best.round,
                         "dev_nll": best.dev_nll, **trained_on}, adapter=adapter)
            report.best = {"round": best.round, "dev_nll": best.dev_nll}
            self.talk(f"wrote {cfg.out}-best.safetensors (round {best.round})")
        if cfg.export_peft:
            adapter.export_peft(cfg.out + "-last-peft", z)
            self.talk(f"wrote {cfg.out}-last-peft/")

    def node_files(self) -> List[int]:
        names = os.listdir(self.cfg.out) if os.path.isdir(self.cfg.out) else []
        return [int(n[5:-12]) for n in names if n.startswith("node-") and n.endswith(".safetensors")
                and n[5:-12].isdigit()]

    def report_path(self, kind: Optional[str] = None) -> str:
        """``<report_dir>/<name>-train.json``, or ``<name>-train-<kind>.json`` beside it."""
        name = os.path.basename(self.cfg.out)
        return os.path.join(self.cfg.report_dir, f"{name}-train{'-' + kind if kind else ''}.json")

    def write_report(self, report: TrainReport, kind: Optional[str] = None) -> None:
        if self.rank != 0:
            return
        path = self.report_path(kind)
        atomic_write_json(path, report.as_dict())
        self.talk(f"wrote {path}")


@torch.no_grad()
def delta_w_rel(adapter: "BOnlyLoRA", vec: torch.Tensor, lora_alpha: float, lora_rank: int) -> float:
    """||sum of scaled B A|| / ||W|| over the adapted projections, with ``vec`` loaded."""
    adapter.load_vector(vec)
    num = den = 0.0
    scale = lora_alpha / lora_rank
    base = adapter.model.get_base_model()
    for name, _shape, _off in adapter.layout():
        mod = base.get_submodule(name)
        a = mod.lora_A["default"].weight.float()
        b = mod.lora_B["default"].weight.float()
        num += float((scale * (b @ a)).pow(2).sum())
        den += float(mod.base_layer.weight.float().pow(2).sum())
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)
