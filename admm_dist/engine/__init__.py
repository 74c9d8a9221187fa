"""The distributed engine: consensus ADMM over a communicator, and the processes that run it.

- :mod:`~admm_dist.engine.dist`: the one place that reads the torchrun/SLURM environment and
  chooses the backend from the device; the process group's lifetime; the backend's failures
  told from bugs;
- :mod:`~admm_dist.engine.job`: what the ranks tell one another through torchrun's agent store:
  the roll call that names a rank that went away, the job's first failure (said once);
- :mod:`~admm_dist.engine.comm`: the communicator interface, its process-group
  implementations (coordinator all_reduce, ring and gossip send/recv) and the single-process
  oracle, with bytes measured by a meter;
- :mod:`~admm_dist.engine.codec`: the int8 / fp8 / int4 block codec of compressed consensus;
- :mod:`~admm_dist.engine.admm`: the ADMM round (x-step callback, z and dual updates,
  residuals), which never touches ranks;
- :mod:`~admm_dist.engine.preemption`: SIGUSR2 noted and agreed, PID files, ``status.json``;
- :mod:`~admm_dist.engine.lsq`: the engine on distributed least squares (closed-form check).

Imports: :mod:`admm_dist.core` only.
"""
