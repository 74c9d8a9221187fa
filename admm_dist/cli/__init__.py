"""The commands: argument parsing and wiring only. ``train`` and ``evaluate`` are also
``python -m admm_dist.train`` / ``python -m admm_dist.evaluate`` and the console scripts;
``build_fitset`` and ``judge_fitset`` are ``python -m admm_dist.cli.<name>``.

Nothing below this layer imports it.
"""
