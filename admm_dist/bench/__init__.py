"""Benchmarks a user runs on their own hardware, printing figures measured side by side:
``python -m admm_dist.bench.<name>`` with name ``comm`` (the consensus communicators),
``xstep`` (the local x-step vs TRL's DPOTrainer, and the round overhead) or ``gpu_check`` (the
x-step, a single-process run and collection on one GPU, in one report). The other modules are
their parts: ``comm_wire``, ``xstep_measure``, ``gpu_report``, ``shapes`` (the model shapes,
also runnable to save a backbone), ``interleave``, ``common`` and ``launcher`` (a bounded local
multi-process launch, also used by the tests). The project's own studies are not here: they
live in ``benchmarks/`` at the repository's root. The top layer: anything below may be
imported."""
