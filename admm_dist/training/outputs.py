"""A run's outputs (docs/design.md section 7): the paths checked before any work, the result files
written at the end, and the training report.

- Before anything loads, :meth:`RunOutputs.check` locks the run's paths for its lifetime
  (:mod:`admm_dist.core.lock`), refuses unwritable paths, a fresh run that would mix with
  another run's files and another run's report under the same name (every rank checks; every
  rank stops on any problem). :meth:`RunOutputs.clear_old_run` removes an overwritten run's
  files only once everything has been checked and loaded.
- At the end, :meth:`RunOutputs.write_results` writes ``<out>/node-<i>.safetensors`` (x, z, u
  per node), ``<out>/seat_map.json``, ``<out>/config.yaml``, ``<report_dir>/<name>-train.json``,
  ``<out>-best.safetensors`` (the lowest held-out NLL), ``<out>-last-peft/`` and
  ``<out>-last.safetensors`` (the consensus z): staged, agreed by every rank, then renamed.
- :meth:`RunOutputs.write_report` writes a refused, preempted or dry run's report to
  ``<name>-train-<kind>.json``, beside ``<name>-train.json`` and never over it.
- :meth:`RunOutputs.open_tracker` opens ``report_to``'s trackers in ``tracking_dir``
  (:mod:`~admm_dist.training.tracking`); a fresh run refuses a folder holding another run's
  TensorBoard events unless ``overwrite=true``, which removes them.
"""
from __future__ import annotations

import functools
import json
import math
import os
import shutil
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence

import torch
from safetensors.torch import save as st_save

from admm_dist.core.config_file import dump_yaml
from admm_dist.core.errors import RunError, UserError
from admm_dist.core.io import atomic_write_bytes, atomic_write_json
from admm_dist.core.staging import Staged
from admm_dist.core.lock import LockedError, OutputLock
from admm_dist.model.vectors import save_vector
from admm_dist.training import checkpoint as ckpt
from admm_dist.training.config import TrainConfig
from admm_dist.training.report import TrainReport
from admm_dist.training.tracking import Tracker, TrackingConfig, collection_scalars, event_files, open_tracker

if TYPE_CHECKING:
    from admm_dist.engine.admm import ADMMEngine
    from admm_dist.engine.control import Control
    from admm_dist.model.adapter import BOnlyLoRA
    from admm_dist.training.state import BestRound, RunRecord


class RefusedError(UserError):
    """The run finished but its result is refused (the adapter did not move, or diverged):
    no result file is written, the report goes to ``<name>-train-refused.json``."""


def refusal(cfg: TrainConfig, dw: Sequence[float], node_sizes: Optional[Sequence[int]]) -> Optional[str]:
    """Why a finished run's result must not be written (its nodes' delta_w_rel ``dw``), or None.

    Every node should move, except under ``local_only`` a node with no examples (f_i = 0,
    nothing couples it to the others): its x_i staying at x^0 is the right answer. A node that
    moved past ``max_delta_w_rel`` diverged."""
    sizes = node_sizes or [1] * len(dw)
    kept = "; any earlier result in out= is kept"
    should = [i for i, d in enumerate(dw) if not (cfg.local_only and sizes[i] == 0)]
    still = [i for i in should if not (math.isfinite(dw[i]) and dw[i] >= 1e-6)]
    if not should:
        return (f"refusing to write {cfg.out}: no node had examples to train on, so none moved: check the "
                f"fit set{kept}")
    if still:
        return (f"refusing to write {cfg.out}: the adapter of node(s) {still} did not move "
                f"(delta_w_rel={list(dw)}); raise --eta or --k_outer{kept}")
    wild = [i for i, d in enumerate(dw) if d > cfg.max_delta_w_rel]
    if wild:
        return (f"refusing to write {cfg.out}: the run diverged (delta_w_rel of node(s) {wild} = "
                f"{max(dw[i] for i in wild):.3g} > max_delta_w_rel={cfg.max_delta_w_rel:g}): "
                f"lower --eta or --grad_clip{kept}")
    return None


class RunOutputs:
    """The output paths of one run, seen from one rank."""

    def __init__(self, cfg: TrainConfig, rank: int, talk: Callable[[str], None]):
        self.cfg = cfg
        self.rank = rank
        self.talk = talk
        self.lock: Optional[OutputLock] = None   # rank 0's, from check() to release()

    # ------------------------------------------------------------------ before any work
    def check(self, control: "Control") -> None:
        """Lock the run's paths, then check that every output path is writable and that a fresh
        run does not mix with another run's files (every rank checks; every rank stops on any
        problem; nothing is removed here: see :meth:`clear_old_run`).

        Rank 0 locks ``<out>.lock`` and ``<report_dir>/<name>-train.json.lock`` for the whole run, so
        a second run into the same ``out`` (or under the same report name) is refused while this
        one lives. A fresh run (``resume=never``) into an ``out`` that holds checkpoints or
        results is refused unless ``overwrite=true``; ``resume=auto`` with results but no
        checkpoints is refused the same way; a report of another run under this name is refused.
        """
        problem = self.problem()    # paths first: the lock creates folders
        if problem is None and self.rank == 0:
            try:
                self.lock = self.make_lock().acquire()
            except LockedError as e:
                problem = str(e)
            else:
                problem = self.problem()   # again, under the lock: a run that just finished counts
        anyone = control.any(problem is not None)
        if problem is not None:
            raise UserError(problem)
        if anyone:
            raise UserError("another rank found a problem with the output paths (see its message)")
        for note in self.lock.notes if self.lock else []:
            self.talk(note)

    def make_lock(self) -> OutputLock:
        cfg = self.cfg
        report = self.report_path()   # its lock is <report>.lock: an out= aimed at it takes the same lock
        return OutputLock([(cfg.out, f"out={cfg.out}", "another out="),
                           (report, f"the report name {report}", "another report_dir= or out= name")])

    def release(self) -> None:
        """Give up the locks (the run has ended, however it ended)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def clear_old_run(self, control: "Control") -> None:
        """With ``overwrite=true``, once every check has passed and everything has loaded:
        remove the old run's checkpoints, TensorBoard events and refused/preempted/dry-run
        reports. Its results stay until this run's replace them (:meth:`write_results`), so a
        new run that is refused leaves them in place."""
        cfg = self.cfg
        if not cfg.overwrite or cfg.dry_run:
            return
        if self.rank == 0:
            root = ckpt.ckpt_root(cfg.out)
            if os.path.isdir(root):
                ckpt.remove_all(root)
                self.talk(f"overwrite: removed the checkpoints in {root}")
            stale = event_files(self.tracking_folder())
            for path in stale:
                os.unlink(path)
            if stale:
                self.talk(f"overwrite: removed {len(stale)} TensorBoard event file(s) in "
                          f"{self.tracking_folder()}")
            for kind in ("refused", "preempted", "dryrun"):
                if os.path.isfile(self.report_path(kind)):
                    os.unlink(self.report_path(kind))
        control.barrier()  # removal seen by all

    def report_owner(self) -> Optional[str]:
        """The report of another run under this run's report name (its path and out), or None."""
        mine = os.path.realpath(self.cfg.out)
        for kind in (None, "refused", "preempted", "dryrun"):
            path = self.report_path(kind)
            try:
                with open(path, encoding="utf-8") as fh:
                    owner = json.load(fh).get("out_path")
            except (OSError, ValueError, AttributeError):
                continue
            # two names of one folder: one run
            if isinstance(owner, str) and os.path.realpath(owner) != mine:
                return f"{path} (out={owner})"
        return None

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
            if what == "the checkpoint folder" and os.path.islink(folder):   # out itself is a real path
                return (f"{what} {folder} is a symbolic link, where the trainer keeps its own folder: remove "
                        f"the link, or choose another {fix}")
            if os.path.exists(folder) and not os.path.isdir(folder):
                return f"{what} {folder} exists and is not a folder: choose another {fix}"
            here = os.path.abspath(folder)   # nothing is created yet: the nearest existing folder decides
            while not os.path.exists(here):
                here = os.path.dirname(here)
            if not os.path.isdir(here):
                return f"{what} {folder} cannot be created: {here} is a file; choose another {fix}"
            if not os.access(here, os.W_OK | os.X_OK):
                return (f"cannot write to {what} {folder} ({here} is read-only or not ours): choose a "
                        f"writable {fix}")
        for path, kind in ((out + "-last.safetensors", "file"), (out + "-best.safetensors", "file"),
                           (out + "-last-peft", "folder")):
            if os.path.exists(path) and (os.path.isdir(path) != (kind == "folder")):
                return f"{path} exists and is not a {kind}: move it away or choose another out="
        other = self.report_owner()
        if other:
            return (f"report_dir {cfg.report_dir} holds the report of another run named alike, {other}: "
                    "choose another report_dir= or another name in out=")
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
        if (cfg.resume == "never" and "tensorboard" in self.tracking.active
                and event_files(self.tracking_folder())):
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

    def open_tracker(self, control: "Control", fingerprint: str, resumed_after: int,
                     record: "RunRecord") -> Tracker:
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
        anyone = control.any(failed is not None)
        if failed is not None:
            raise failed
        if anyone:
            raise UserError("rank 0 could not open the trackers of report_to (see its message)")
        if tracker.active:
            self.talk(f"tracking ({', '.join(self.tracking.active)}) in {self.tracking_folder()}")
            for stats in (record.collections if not resumed_after else []):
                tracker.log(stats["collection"] * cfg.recollect_every, collection_scalars(stats))
        return tracker

    # ------------------------------------------------------------------ at the end
    def write_results(self, *, engine: "ADMMEngine", control: "Control", nodes: Sequence[int],
                      adapter: "BOnlyLoRA", report: TrainReport, best: Optional["BestRound"],
                      deploy_local: bool, fingerprint: str) -> None:
        """Write the results and the report, agreed by every rank: all of them, or none.

        1. Every rank writes its node files, and rank 0 the seat map, the config, the report,
           ``-best``, the PEFT folder and ``-last``, each to a staged path beside its own.
        2. The ranks agree: if any rank failed, every rank removes what it staged and stops
           (the failing rank names the path; the others say a peer failed), and nothing in
           ``out`` is replaced.
        3. Every rank renames its staged files into place; rank 0 renames ``-last`` last, and
           removes the old run's result files this run does not write (``-best`` of a run with
           a dev split, the PEFT folder, extra node files). A failure here is agreed on too,
           so rank 0 never reports ``done`` alone.
        """
        cfg = self.cfg
        staged = Staged()
        failed: Optional[BaseException] = None
        written: List[str] = []
        try:
            for j, node in enumerate(nodes):
                self._remove_orphans(cfg.out, [f"node-{node}.safetensors"])
                tensors = {k: v.detach().cpu().contiguous() for k, v in
                           (("x", engine.x[j]), ("z", engine.z[j]), ("u", engine.u[j]))}
                blob = st_save(tensors, metadata={"round": str(engine.round), "fingerprint": fingerprint,
                                                  "node": str(node)})
                atomic_write_bytes(staged.file(os.path.join(cfg.out, f"node-{node}.safetensors")), blob)
            if self.rank == 0:
                written = self._stage_rank0(staged, engine=engine, adapter=adapter, report=report,
                                            best=best, deploy_local=deploy_local, fingerprint=fingerprint)
        except Exception as exc:   # every rank must hear of it before anything is replaced
            failed = exc
        self._agree(control, failed, staged,
                    "a peer rank could not write its results (see its message): nothing in out= was replaced "
                    "and the last checkpoint is kept; fix that and rerun with resume=auto")
        try:
            staged.commit()
            if self.rank == 0:
                self._remove_stale(engine.comm.n_nodes, written)
        except OSError as exc:
            failed = exc
        self._agree(control, failed, staged,
                    "a peer rank could not move its results into place (see its message): the results in "
                    "out= are incomplete; fix that and rerun with resume=auto (the last checkpoint is kept)")
        for path in written:
            self.talk(f"wrote {path}")

    def _agree(self, control: "Control", failed: Optional[BaseException], staged: Staged,
               peer_message: str) -> None:
        anyone = control.any(failed is not None)
        if anyone:
            staged.discard()
        if failed is not None:
            raise failed
        if anyone:
            raise RunError(peer_message)

    def _stage_rank0(self, staged: Staged, *, engine: "ADMMEngine", adapter: "BOnlyLoRA",
                     report: TrainReport, best: Optional["BestRound"], deploy_local: bool,
                     fingerprint: str) -> List[str]:
        """Rank 0's result files, staged; the final paths, in the order they will be renamed."""
        cfg = self.cfg
        out = cfg.out
        self._remove_orphans(out, ["seat_map.json", "config.yaml"])
        self._remove_orphans(os.path.dirname(os.path.abspath(out)),
                             [os.path.basename(out) + s for s in ("-last.safetensors", "-best.safetensors")])
        meta = {"config": cfg.as_dict(), "seats": cfg.adapted_seats(),
                "roles": [cfg.role(s) for s in cfg.adapted_seats()],
                "n_nodes": engine.comm.n_nodes, "round": engine.round, "fingerprint": fingerprint}
        anchor_keys = list(report.get("anchor_keys") or [])
        atomic_write_json(staged.file(os.path.join(out, "seat_map.json")),
                          dict(meta, deploy_required="local" if deploy_local else None,
                               anchor_keys=anchor_keys,
                               node_of_seat={str(s): (0 if cfg.pooled else i)
                                             for i, s in enumerate(cfg.adapted_seats())}))
        atomic_write_bytes(staged.file(os.path.join(out, "config.yaml")), dump_yaml(cfg).encode())
        written = [f"{out}/"]
        z = engine.z[0]
        # A copied adapter keeps the leakage check: it carries the training queries' keys.
        trained_on = {"anchor_keys": anchor_keys, "report": os.path.realpath(self.report_path())}
        if best is not None and not cfg.local_only:
            report.best = {"round": best.round, "dev_nll": best.dev_nll}
        atomic_write_json(staged.file(self.report_path()), report.as_dict())
        written.append(self.report_path())
        if cfg.local_only:
            return written
        if best is not None:
            save_vector(staged.file(out + "-best.safetensors"), best.z,
                        {"selection": "lowest held-out NLL", "round": best.round,
                         "dev_nll": best.dev_nll, **trained_on}, adapter=adapter)
            written.append(out + "-best.safetensors")
        if cfg.export_peft:
            adapter.export_peft(staged.folder(out + "-last-peft"), z)
            written.append(out + "-last-peft/")
        save_vector(staged.file(out + "-last.safetensors"), z,
                    {"selection": "final consensus variable z", "round": engine.round,
                     "deploy_required": "local" if deploy_local else None, **trained_on}, adapter=adapter)
        written.append(out + "-last.safetensors")
        return written

    def _remove_stale(self, n_nodes: int, written: Sequence[str]) -> None:
        """The old run's result files that this run did not write (it replaced the others)."""
        out = self.cfg.out
        for stale in (k for k in self.node_files() if k >= n_nodes):
            os.unlink(os.path.join(out, f"node-{stale}.safetensors"))
        for path in (out + "-best.safetensors", out + "-last-peft/", out + "-last.safetensors"):
            if path not in written and os.path.lexists(path.rstrip("/")):
                if os.path.isdir(path.rstrip("/")):
                    shutil.rmtree(path.rstrip("/"))
                else:
                    os.unlink(path)
                self.talk(f"removed {path.rstrip('/')}, an older result this run does not replace")

    @staticmethod
    def _remove_orphans(folder: str, names: Sequence[str]) -> None:
        """Temporaries a killed write of ``names`` left in ``folder`` (this run holds the lock)."""
        try:
            entries = os.listdir(folder)
        except OSError:
            return
        prefixes = tuple(f".{n}." for n in names) + tuple(f"..{n}.staged." for n in names)
        for entry in entries:
            if entry.startswith(prefixes) and entry.endswith((".tmp", ".staged", ".staged.old")):
                path = os.path.join(folder, entry)
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)

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
    for (name, _shape, _off), w_sq in zip(adapter.layout(), adapter.base_sq):
        mod = base.get_submodule(name)
        a = mod.lora_A["default"].weight.float()
        b = mod.lora_B["default"].weight.float()
        num += float((scale * (b @ a)).pow(2).sum())
        den += w_sq
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)
