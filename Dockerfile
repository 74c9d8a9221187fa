# CUDA PyTorch base: torch, CUDA and NCCL come from the image; the package adds the rest.
FROM pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime

# bubblewrap isolates model-written code (coding tasks, docs/sandbox.md); as root it needs
# CAP_SYS_ADMIN: docker run --cap-add SYS_ADMIN --security-opt seccomp=unconfined ...
# (without it coding tasks are refused with a one-line message; other tasks are unaffected).
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/admm_dist
COPY setup.cfg pyproject.toml README.md ./
COPY admm_dist ./admm_dist
COPY launch ./launch
COPY configs ./configs
COPY assets ./assets
# the trackers (report_to=tensorboard|wandb) and the plot command come with the image
RUN python -m pip install --no-cache-dir -e ".[tensorboard,wandb,plot]" \
 && python -c "import admm_dist, torch; print('torch', torch.__version__)"

ENV OMP_NUM_THREADS=1
# Default: the CPU demo on the shipped stand-in (accuracy before, on-policy collection and
# 4-rank ADMM on gloo, accuracy after; about two minutes).
# A real run: docker run --gpus all IMAGE torchrun --standalone --nproc_per_node 4 \
#     -m admm_dist.train --config configs/admm_ring.yaml fitset_cache=/data/fitset.jsonl
CMD ["bash", "launch/cpu_demo.sh"]
