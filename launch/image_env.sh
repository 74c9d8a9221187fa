#!/usr/bin/env bash
# The Dockerfile's install steps in a fresh venv, for machines (CI) without docker:
#
#   bash launch/image_env.sh         # VENV=... to keep the venv there (default: a temporary
#                                    #   one, removed at the end)
#
# Runs what the image runs (bash launch/install.sh image: torch at launch/constraints.txt, then
# the package, not editable, with its trackers and plot command) into a venv of its own, then
# imports the installed package from outside the clone and checks its torch is the pinned one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -z "${VENV:-}" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  VENV=$tmp/venv
fi
"$PY" -m venv "$VENV"
# PIP_NO_COMPILE: the venv is imported once, here; compiling its bytecode (most of it torch's)
# would cost a third of this script's time
PIP_NO_COMPILE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHON="$VENV/bin/python" bash launch/install.sh image
want=$(sed -n 's/^torch==//p' launch/constraints.txt)
(cd / && "$VENV/bin/python" - "$want" <<'PY'
import sys

import torch

import admm_dist
import admm_dist.model.sharding  # noqa: F401  (FSDP2 and DTensor of this torch)
import admm_dist.train  # noqa: F401

assert "site-packages" in admm_dist.__file__, admm_dist.__file__   # the installed copy, not the clone
assert torch.__version__.split("+")[0] == sys.argv[1], (torch.__version__, sys.argv[1])
print(f"image install: admm_dist from {admm_dist.__file__}, torch {torch.__version__}")
PY
)
