# The GPU job's image: Python 3.11 and the torch every suite runs on (launch/constraints.txt),
# installed by the steps .ci/run also runs in a fresh venv (launch/image_env.sh). From PyPI
# that torch is the CUDA build, with CUDA's and NCCL's libraries as wheels; the driver comes
# from the host (the NVIDIA container toolkit: docker run --gpus all ...).
FROM python:3.11-slim-bookworm

# bubblewrap isolates model-written code (coding tasks, docs/sandbox.md); as root it needs
# CAP_SYS_ADMIN: docker run --cap-add SYS_ADMIN --security-opt seccomp=unconfined ...
# (without it coding tasks are refused with a one-line message; other tasks are unaffected).
# Not pinned to a version: Debian replaces a package's version with its security update, so a
# pin breaks the build; the image's tag fixes the release (bookworm).
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/admm_dist
COPY setup.cfg pyproject.toml README.md ./
COPY admm_dist ./admm_dist
COPY launch ./launch
COPY configs ./configs
COPY assets ./assets
# the package (not editable) with the trackers (report_to=tensorboard|wandb) and the plot command
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN bash launch/install.sh image

ENV OMP_NUM_THREADS=1
# Default: the CPU demo on the shipped stand-in (accuracy before, on-policy collection and
# 4-rank ADMM on gloo, accuracy after; about two minutes).
# A real run: docker run --gpus all IMAGE torchrun --standalone --nproc_per_node 4 \
#     -m admm_dist.train --config configs/admm_ring.yaml fitset_cache=/data/fitset.jsonl
CMD ["bash", "launch/cpu_demo.sh"]
