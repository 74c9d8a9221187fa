"""The bottom layer: what every other layer may use and that uses nothing of ``admm_dist``.

- :mod:`~admm_dist.core.errors`: the error hierarchy (one base class; user errors are one line
  and exit code 2);
- :mod:`~admm_dist.core.io`: atomic, umask-respecting file and folder writes;
- :mod:`~admm_dist.core.config_file`: dataclass defaults, then YAML, then ``key=value``
  overrides, unknown keys rejected;
- :mod:`~admm_dist.core.text`: the words every layer shares (``</think>``, choice letters,
  the visible part of a message);
- :mod:`~admm_dist.core.constants`: the named seed salts and the one default timeout;
- :mod:`~admm_dist.core.libraries`: keeping third-party libraries quiet on stderr;
- :mod:`~admm_dist.core.progress`: progress bars, drawn only on a terminal.

Layers, bottom to top (a module imports only from its own layer and the ones below; the test
``tests/test_layers.py`` checks it): core, engine, model, tasks, data, mas, training,
demo, plots, cli, bench.
"""
