"""Test-only fault injection, kept out of the run's configuration.

``ADMM_DIST_FAULT_AT`` in a worker's environment plans one fault:

- ``ROUND:NODE``: the rank holding NODE exits (code 17) right after round ROUND's checkpoint,
  on the first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), so an elastic restart resumes;
- ``nan@ROUND:NODE``: NODE's local loss is NaN in round ROUND (the engine must stop the run
  with the round and node named).

The training command reads it (:func:`from_env`) and hands the plan to the trainer, which
only calls :meth:`FaultPlan.poison` and :meth:`FaultPlan.after_round`.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

from admm_dist.core.errors import UserError

ENV = "ADMM_DIST_FAULT_AT"
EXIT_CODE = 17


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    kind: str        # "kill" or "nan"
    round: int
    node: int

    @classmethod
    def parse(cls, spec: str) -> "FaultPlan":
        kind = "nan" if spec.startswith("nan@") else "kill"
        parts = spec.removeprefix("nan@").split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise UserError(f"{ENV}={spec!r}: write ROUND:NODE or nan@ROUND:NODE, e.g. 3:1")
        return cls(kind, int(parts[0]), int(parts[1]))

    def poison(self, round_: int, node: int) -> bool:
        """True if ``node``'s loss in ``round_`` is to be NaN."""
        return self.kind == "nan" and self.round == round_ and self.node == node

    def after_round(self, round_: int, nodes: Sequence[int]) -> None:
        """Exit this process if the plan kills one of its ``nodes`` after ``round_``."""
        first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
        if self.kind == "kill" and self.round == round_ and self.node in nodes and first_attempt:
            os._exit(EXIT_CODE)


def from_env() -> Optional[FaultPlan]:
    spec = os.environ.get(ENV)
    return FaultPlan.parse(spec) if spec else None
