"""Pictures of finished runs: ``python -m admm_dist.plot INPUT.json [...] --out DIR``.

- :mod:`~admm_dist.plots.series`: the inputs, read and checked: a training report
  (``<name>-train.json``), an evaluation result (``python -m admm_dist.evaluate --json``) or a
  benchmark summary (``docs/bench_fidelity.json``), each recognised by its content and turned
  into a small typed series. Pure Python: it never imports matplotlib.
- :mod:`~admm_dist.plots.figures`: one function per figure (a series in, a matplotlib
  ``Figure`` out), the PNG writer and :func:`~admm_dist.plots.figures.draw_all`, which the
  command calls.

This layer imports only :mod:`admm_dist.core` (and matplotlib). matplotlib is imported only
here, and lazily: by :mod:`~admm_dist.plots.figures`, which nothing imports at module level
(the command imports it when it runs), and only through the Agg canvas: no pyplot, no global
backend, no window.
"""
