"""The commands: argument parsing and wiring only, one module per command.

- ``train`` and ``evaluate``: also ``python -m admm_dist.train`` / ``python -m admm_dist.evaluate``
  (the shims at the top of the package) and the console scripts ``admm-dist-train`` /
  ``admm-dist-evaluate``;
- ``plot``: PNGs of training reports, evaluation results and the benchmark summary (also
  ``python -m admm_dist.plot`` and ``admm-dist-plot``);
- ``build_fitset``, ``judge_fitset``: stored trajectories -> a (judged) fit set;
- ``lsq``: the engine on distributed least squares;
- ``pretrained``: a packaged pretrained model's folder, built offline;
- ``standin``, ``synthetic``: the stand-in backbone and the tiny synthetic assets;
- ``common``: what they share (one-line errors with exit code 2).

Each is ``python -m admm_dist.cli.<name>``. Nothing below this layer imports it.
"""
