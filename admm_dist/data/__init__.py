"""The data layer: fit sets (the examples each node trains on) and the query pool.

- :mod:`~admm_dist.data.fitset`: the fit-set file (JSONL, versioned, settings-keyed), its
  checks, the derived objectives' examples, filters, the dev split and the partition onto
  nodes;
- :mod:`~admm_dist.data.queries`: a task's rows shuffled by a seed, the anchor pool.

Imports: :mod:`admm_dist.core` and :mod:`admm_dist.tasks`.
"""
