"""Test-only fault injection, kept out of the run's configuration.

``ADMM_DIST_FAULT_AT`` in a worker's environment plans one fault:

- ``ROUND:NODE``: the rank holding NODE exits (code 17) right after round ROUND's checkpoint,
  on the first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), so an elastic restart resumes;
- ``nan@ROUND:NODE``: NODE's local loss is NaN in round ROUND (the engine must stop the run
  with the round and node named);
- ``ckpt@ROUND:NODE:POINT``: the rank holding NODE is SIGKILLed (by its own PID) while it writes
  NODE's checkpoint of round ROUND, at POINT, on the first attempt only. POINT is one of
  :data:`POINTS`: before the tensors, with the tensors' temporary written but not renamed,
  between the tensors and the JSON marker, with the marker's temporary not renamed, or right
  after the marker.

The training command reads it (:func:`from_env`) and hands the plan to the trainer, which
only calls :meth:`FaultPlan.poison` and :meth:`FaultPlan.after_round`.
"""
from __future__ import annotations

import dataclasses
import os
import signal
from typing import Optional, Sequence

from admm_dist.core.errors import UserError

ENV = "ADMM_DIST_FAULT_AT"
EXIT_CODE = 17
POINTS = ("tensors", "tensors-renaming", "tensors-written", "json-renaming", "json-written")


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    kind: str        # "kill", "nan" or "ckpt"
    round: int
    node: int
    point: str = ""  # ckpt: where in the checkpoint write

    @classmethod
    def parse(cls, spec: str) -> "FaultPlan":
        kind = "nan" if spec.startswith("nan@") else "ckpt" if spec.startswith("ckpt@") else "kill"
        parts = spec.split("@", 1)[-1].split(":")
        point = parts.pop() if kind == "ckpt" and len(parts) == 3 else ""
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or (kind == "ckpt") != bool(point) \
                or (point and point not in POINTS):
            raise UserError(f"{ENV}={spec!r}: write ROUND:NODE, nan@ROUND:NODE or ckpt@ROUND:NODE:POINT "
                            f"(POINT one of {', '.join(POINTS)}), e.g. 3:1")
        return cls(kind, int(parts[0]), int(parts[1]), point)

    def poison(self, round_: int, node: int) -> bool:
        """True if ``node``'s loss in ``round_`` is to be NaN."""
        return self.kind == "nan" and self.round == round_ and self.node == node

    def after_round(self, round_: int, nodes: Sequence[int]) -> None:
        """Exit this process if the plan kills one of its ``nodes`` after ``round_``."""
        first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
        if self.kind == "kill" and self.round == round_ and self.node in nodes and first_attempt:
            os._exit(EXIT_CODE)


    def in_checkpoint(self, round_: int, node: int, point: str) -> None:
        """SIGKILL this process if the plan kills ``node``'s checkpoint write of ``round_`` here."""
        if self.kind == "ckpt" and (self.round, self.node, self.point) == (round_, node, point) \
                and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
            os.kill(os.getpid(), signal.SIGKILL)


def from_env() -> Optional[FaultPlan]:
    spec = os.environ.get(ENV)
    return FaultPlan.parse(spec) if spec else None
