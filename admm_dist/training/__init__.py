"""The training layer: the run's configuration, the trainer that wires the layers below into
rounds of consensus ADMM, checkpoints, the run's outputs and its experiment trackers
(TensorBoard, W&B: rank 0 logs every node's round figures).

Imports: every layer below (core, engine, model, tasks, data, mas).
"""
