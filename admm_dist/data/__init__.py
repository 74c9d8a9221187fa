"""The data layer: fit sets (the examples each node trains on) and the query pool.

- :mod:`~admm_dist.data.fitset`: the examples and the fit-set file (JSONL, versioned,
  settings-keyed), its checks and keys;
- :mod:`~admm_dist.data.derive`: the derived objectives' examples (sft, rsft, dpo pairs) and
  the filters (unclosed think blocks, repeated visible targets, target composition);
- :mod:`~admm_dist.data.partition`: the examples per seat, the dev split and the partition
  onto nodes;
- :mod:`~admm_dist.data.queries`: a task's rows shuffled by a seed, the anchor pool;
- :mod:`~admm_dist.data.sampler`: the role-balanced, checkpointable minibatch stream.

Imports: :mod:`admm_dist.core` and :mod:`admm_dist.tasks`.
"""
