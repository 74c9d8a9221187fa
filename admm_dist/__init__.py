"""admm_dist: consensus-ADMM training of an LLM multi-agent system, one torchrun rank per seat.

Entry points: ``python -m admm_dist.train`` (the trainer), ``python -m admm_dist.evaluate``
(the chain on a task's evaluation rows), ``python -m admm_dist.plot`` (PNGs of reports),
``python -m admm_dist.cli.lsq`` (the engine on distributed least squares) and
``python -m admm_dist.bench.<name>``: the benchmarks a user runs on their own hardware (comm,
xstep, gpu_check). The project's own studies live outside the package, in ``benchmarks/``, and
run from a clone as ``python -m benchmarks.<name>``.

The package is layered, bottom to top; a module imports only from its own layer and those
below it (``tests/test_layers.py``):

    core      errors, atomic files, config files, shared text conventions, constants
    engine    environment and process group, communicators, ADMM, preemption
    model     backbone loading, the B-only LoRA adapter, objectives
    tasks     task registry, loaders, scoring, the code sandbox
    data      fit sets, the query pool
    mas       seats, prompts, generation, the chain, collection, evaluation, judge
    training  the run's config, the trainer, checkpoints, outputs, experiment tracking
    demo      tiny and stand-in backbones, synthetic fit sets: what the built-in CPU default runs on
    plots     reading reports and drawing them (matplotlib)
    cli       argument parsing for every command
    bench     the benchmarks a user runs on their own hardware (comm, xstep, gpu_check)

See README.md and docs/design.md.
"""

__version__ = "0.1.0"
