"""Experiment tracking: every round's figures into TensorBoard and/or Weights & Biases.

``report_to`` names the trackers (``none``, ``tensorboard``, ``wandb``, or several joined by
commas). Only rank 0 writes: every node's figures already reach it in the round's
:class:`~admm_dist.engine.admm.RoundRecord` (the engine's telemetry gather), so tracking adds
no communication. W&B runs offline unless ``wandb_mode=online``; ``wandb sync`` uploads an
offline run later. Files go to ``tracking_dir`` (default ``<report_dir>/tracking/<name>``,
``name`` the last part of ``out``), so ``tensorboard --logdir <report_dir>/tracking`` shows
every run of a report folder side by side.

What is logged, at step = round (docs/outputs.md has the table):

- per node i: ``loss/node_i`` (f_i), ``primal_residual/node_i`` (||x_i - z_i||),
  ``primal_residual_normalized/node_i`` (/ ||z_i||), ``dual_residual/node_i``
  (rho ||z_i^k - z_i^{k-1}||), ``bytes_sent/consensus/node_i``, ``bytes_recv/consensus/node_i``
  (on the wire), ``bytes_in_process/consensus/node_i`` (handed to a node of the same rank in
  memory), ``seconds/x_step/node_i``, ``seconds/z_step/node_i``, ``seconds/other/node_i``;
- ``bytes_sent/telemetry``, ``bytes_recv/telemetry``: the round's telemetry gathers (the same
  on every node: they are all_gathers of equal rows);
- ``admm/rho``, ``admm/x1_norm``, ``admm/delta_w_rel`` (||dW|| / ||W|| of node 0's z),
  ``dev/nll`` on the rounds that measure it;
- ``collection/<stat>`` (queries, kept queries, examples, pass rate, mixed-group rate,
  seconds) at the round after which the collection ran (0 for the first);
- ``final/delta_w_rel`` (``final/delta_w_rel/node_i`` for a locally deployed run) at the last round.

The resolved configuration goes with the run: as W&B's run config, and as a YAML text
summary (``config``) in TensorBoard.

TensorBoard's events are written in the calling thread and flushed every round: a full or
removed ``tracking_dir`` is one :class:`UserError` naming it, with no thread traceback. A run
resumed after round K (``resume=auto``) makes the readers drop what an earlier attempt logged
past K (:func:`purge_step`); one that starts from round 0 removes an earlier attempt's event
files. Every curve has one value per step.
"""
from __future__ import annotations

import dataclasses
import errno
import glob
import importlib.util
import itertools
import math
import os
import socket
import time
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence

from admm_dist.core.config_file import key
from admm_dist.core.errors import UserError

if TYPE_CHECKING:
    from admm_dist.engine.admm import RoundRecord

TRACKERS = ("none", "tensorboard", "wandb")
EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb"}   # tracker -> its package (and our extra)
WANDB_MODES = ("offline", "online")
EVENTS_GLOB = "events.out.tfevents.*"      # TensorBoard's event files


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    report_to: str = key("none", "where rank 0 logs every round's figures; join several with commas "
                         "(tensorboard,wandb)", choices=TRACKERS, fingerprint="ignored")
    tracking_dir: Optional[str] = key(None, "the trackers' folder (none: <report_dir>/tracking/<run name>)",
                                      metavar="DIR", fingerprint="ignored")
    wandb_project: str = key("admm_dist", "the Weights & Biases project", fingerprint="ignored")
    wandb_mode: str = key("offline", "offline (sync later with wandb sync) or online", choices=WANDB_MODES,
                          fingerprint="ignored")

    def __post_init__(self) -> None:
        names = self.trackers
        bad = [n for n in names if n not in TRACKERS]
        if bad or not names:
            raise UserError(f"report_to={self.report_to!r}: choose from {', '.join(TRACKERS)}, or join "
                            "several with commas (report_to=tensorboard,wandb)")
        if "none" in names and len(names) > 1:
            raise UserError(f"report_to={self.report_to!r}: 'none' cannot be combined with a tracker")
        if self.wandb_mode not in WANDB_MODES:
            raise UserError(f"wandb_mode={self.wandb_mode!r}: choose one of {', '.join(WANDB_MODES)}")
        if not str(self.wandb_project).strip():
            raise UserError("wandb_project='': name the W&B project, e.g. wandb_project=admm_dist")

    @property
    def trackers(self) -> List[str]:
        return [n.strip() for n in str(self.report_to).split(",") if n.strip()]

    @property
    def active(self) -> List[str]:
        """The trackers that write (none for ``report_to=none``)."""
        return [n for n in self.trackers if n != "none"]

    def folder(self, report_dir: str, name: str) -> str:
        return self.tracking_dir or os.path.join(report_dir, "tracking", name)

    def missing(self) -> Optional[str]:
        """What is wrong with this machine for these trackers (a package not installed), or None."""
        absent = [n for n in self.active if not installed(EXTRAS[n])]
        if not absent:
            return None
        extras = ",".join(absent)
        return (f"report_to={self.report_to} needs {' and '.join(absent)}, which is not installed: "
                f"pip install 'admm_dist[{extras}]' (or drop it from report_to)")


def installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:     # sys.modules[package] is None: imports of it are blocked
        return False


def event_files(folder: str) -> List[str]:
    """TensorBoard event files already in ``folder`` (another attempt's, or another run's)."""
    return sorted(glob.glob(os.path.join(folder, EVENTS_GLOB)))


def remove_event_files(folder: str) -> None:
    """Remove the TensorBoard event files in ``folder`` (an earlier attempt's); an error names it."""
    for path in event_files(folder):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise UserError(f"cannot remove the earlier TensorBoard events in tracking_dir {folder}: "
                            f"{exc.strerror or exc} ({path}); remove them, or choose another "
                            "tracking_dir=") from None


# ----------------------------------------------------------------------------- the figures
def round_scalars(rec: "RoundRecord", *, telemetry_sent: int, telemetry_recv: int,
                  dev_nll: Optional[float] = None, delta_w_rel: Optional[float] = None) -> Dict[str, float]:
    """One round's figures, by tracker tag (see the module docstring)."""
    out: Dict[str, float] = {}
    per_node = (("loss", rec.f), ("primal_residual", rec.primal),
                ("primal_residual_normalized", rec.primal_normalized), ("dual_residual", rec.dual),
                ("bytes_sent/consensus", rec.bytes_sent), ("bytes_recv/consensus", rec.bytes_recv),
                ("bytes_in_process/consensus", rec.bytes_in_process),
                ("seconds/x_step", rec.sec_x), ("seconds/z_step", rec.sec_z),
                ("seconds/other", rec.sec_other))
    for tag, values in per_node:
        out.update({f"{tag}/node_{i}": float(v) for i, v in enumerate(values)})
    out.update({"bytes_sent/telemetry": float(telemetry_sent), "bytes_recv/telemetry": float(telemetry_recv),
                "admm/rho": float(rec.rho), "admm/x1_norm": float(rec.x1_norm)})
    if delta_w_rel is not None:
        out["admm/delta_w_rel"] = float(delta_w_rel)
    if dev_nll is not None:
        out["dev/nll"] = float(dev_nll)
    return out


def collection_scalars(stats: Mapping[str, Any]) -> Dict[str, float]:
    """A collection's numeric statistics (the fit set's size and pass rates; pre-screen and reward
    group counts)."""
    out = {f"collection/{k}": float(v) for k, v in stats.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "collection"}
    for part in ("prescreen", "reward_groups"):
        for k, v in (stats.get(part) or {}).items():
            out[f"collection/{part}_{k}"] = float(v)
    return out


def final_scalars(delta_w: Sequence[float], deploy_local: bool) -> Dict[str, float]:
    if deploy_local:
        return {f"final/delta_w_rel/node_{i}": float(d) for i, d in enumerate(delta_w)}
    return {"final/delta_w_rel": float(delta_w[0])}


# ----------------------------------------------------------------------------- the writers
class TensorBoardWriter:
    """Scalars into a TensorBoard event file, written in the calling thread.

    The records are TensorBoard's own (``Event`` protos in TFRecord framing, by tensorboard's
    ``RecordWriter``), as torch's ``SummaryWriter`` writes them; but that writer writes from a
    background thread, so a full or vanished tracking folder prints the thread's traceback and
    surfaces only at a later call. Here every :meth:`log` writes and flushes at once, and a
    failed write is one :class:`UserError` naming ``tracking_dir``.

    ``purge_step``: a ``SessionLog.START`` at that step makes TensorBoard's readers drop the
    events that earlier files of the folder hold at that step or later (an earlier attempt's);
    the new file's name sorts after theirs, so readers load it last.
    """

    def __init__(self, folder: str, config_yaml: Optional[str], purge_step: Optional[int]):
        try:
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.record_writer import RecordWriter
        except ImportError:
            raise UserError("report_to=tensorboard needs the tensorboard package: "
                            "pip install 'admm_dist[tensorboard]' (or drop it from report_to)") from None
        self.folder = folder
        self.Event, self.Summary = Event, Summary
        self.fh: Optional[Any] = None
        try:
            os.makedirs(folder, exist_ok=True)
            self.path = os.path.join(folder, _new_event_file_name(folder))
            self.fh = open(self.path, "xb")      # the mode of a plain open: 0666 less the umask
            self.records = RecordWriter(self.fh)
            self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
            if purge_step is not None:
                self._write(Event(wall_time=time.time(), step=purge_step,
                                  session_log=SessionLog(status=SessionLog.START)))
            if config_yaml is not None:
                self._write(Event(wall_time=time.time(), step=0,
                                  summary=_text_summary("config", "```yaml\n" + config_yaml + "\n```")))
            self.fh.flush()
        except OSError as exc:
            self._fail(exc)

    def _write(self, event: Any) -> None:
        self.records.write(event.SerializeToString())

    def _fail(self, exc: OSError) -> None:
        self.close()
        raise UserError(f"cannot write TensorBoard events to tracking_dir {self.folder}: "
                        f"{exc.strerror or exc} (check its free space and permissions, choose another "
                        "tracking_dir=, or drop tensorboard from report_to)") from None

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        if self.fh is None:
            raise UserError(f"cannot write TensorBoard events to tracking_dir {self.folder}: the writer is "
                            "closed")
        values = [self.Summary.Value(tag=tag, simple_value=float(v)) for tag, v in scalars.items()]
        try:
            if os.fstat(self.fh.fileno()).st_nlink == 0:     # writes to a removed file would vanish
                raise FileNotFoundError(errno.ENOENT,
                                        f"its event file {self.path} was removed during the run")
            self._write(self.Event(wall_time=time.time(), step=int(step), summary=self.Summary(value=values)))
            self.fh.flush()
        except OSError as exc:
            self._fail(exc)

    def close(self) -> None:
        fh, self.fh = self.fh, None
        if fh is not None:
            try:
                fh.close()        # every log() flushed: nothing is left to write
            except OSError:
                pass


_FILE_NUMBER = itertools.count()     # TensorBoard's <n>: this process's event files, numbered


def _new_event_file_name(folder: str) -> str:
    """TensorBoard's name for an event file (``events.out.tfevents.<seconds>.<host>.<pid>.<n>``),
    its seconds past every event file already in ``folder``: readers load a folder's files in
    name order, and an earlier attempt's events must come first for a purge to drop them."""
    seconds = int(time.time())
    for path in event_files(folder):
        parts = os.path.basename(path).split(".")
        if len(parts) > 3 and parts[3].isdigit():
            seconds = max(seconds, int(parts[3]) + 1)
    return f"events.out.tfevents.{seconds:010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILE_NUMBER)}"


def _text_summary(tag: str, text: str) -> Any:
    """A text summary as TensorBoard's text plugin reads it (tag ``<tag>/text_summary``)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
        plugin_name="text", content=TextPluginData(version=0).SerializeToString()))
    tensor = TensorProto(dtype="DT_STRING", string_val=[text.encode("utf-8")],
                         tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
    return Summary(value=[Summary.Value(tag=f"{tag}/text_summary", metadata=metadata, tensor=tensor)])


class WandbWriter:
    """Scalars into a W&B run (offline by default: ``<folder>/wandb/offline-run-*``)."""

    def __init__(self, folder: str, config: Dict[str, Any], *, project: str, mode: str, name: str,
                 run_id: str):
        try:
            import wandb
        except ImportError:
            raise UserError("report_to=wandb needs the wandb package: pip install 'admm_dist[wandb]' "
                            "(or drop it from report_to)") from None
        os.makedirs(folder, exist_ok=True)
        settings = wandb.Settings(silent=True, console="off", disable_git=True, x_disable_stats=True,
                                  disable_code=True)
        self.run = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=folder, mode=mode,
                              config=config, settings=settings)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log({k: (v if math.isfinite(v) else None) for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


class Tracker:
    """The run's trackers, seen from one rank: rank 0 writes to each, other ranks do nothing."""

    def __init__(self, writers: Sequence[Any] = ()):
        self.writers = list(writers)

    @property
    def active(self) -> bool:
        return bool(self.writers)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for w in self.writers:
            w.log(step, scalars)

    def close(self) -> None:
        writers, self.writers = self.writers, []
        for w in writers:
            w.close()


def open_tracker(tcfg: TrackingConfig, *, rank: int, folder: str, name: str, config: Dict[str, Any],
                 config_yaml: str, run_id: str, resumed_after: int = 0) -> Tracker:
    """Rank 0's writers for ``report_to`` (an inactive Tracker elsewhere, or for ``none``).

    ``resumed_after``: the round a resumed run continues after. TensorBoard's readers then drop
    what an earlier attempt in ``folder`` logged past it (:func:`purge_step`). A run that starts
    from round 0 (fresh, or ``resume=auto`` that found no checkpoint) logs everything again: an
    earlier attempt's event files are removed (a fresh run into another run's events was refused
    before any work, or ``overwrite=true`` removed them). Either way a curve has one value per step.
    """
    if rank != 0 or not tcfg.active:
        return Tracker()
    writers: List[Any] = []
    try:
        for kind in tcfg.active:
            if kind == "tensorboard":
                if not resumed_after:
                    remove_event_files(folder)
                writers.append(TensorBoardWriter(folder, None if resumed_after else config_yaml,
                                                 purge_step(resumed_after)))
            else:
                writers.append(WandbWriter(folder, config, project=tcfg.wandb_project, mode=tcfg.wandb_mode,
                                           name=name, run_id=run_id))
    except BaseException:
        Tracker(writers).close()
        raise
    return Tracker(writers)


def purge_step(resumed_after: int) -> Optional[int]:
    """The step from which the events of an earlier attempt are dropped by TensorBoard's readers.

    A run resumed after round K logs rounds K+1 on again (step = round). What the earlier attempt
    logged at K or before stays: round K's figures, and a collection run after round K (logged at
    step ``collection * recollect_every`` = K before round K's checkpoint, which holds its fit
    set; the resumed run does not log it again). A run that starts from round 0 has nothing to
    keep: :func:`open_tracker` removes the earlier attempt's event files instead (None here).
    """
    return resumed_after + 1 if resumed_after else None
