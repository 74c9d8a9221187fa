"""The training layer: the run's configuration, the trainer that wires the layers below into
rounds of consensus ADMM, checkpoints and the run's outputs.

Imports: every layer below (core, engine, model, tasks, data, mas).
"""
