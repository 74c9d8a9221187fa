"""The model layer: a backbone, the B-only LoRA adapter on it, and the training objectives.

- :mod:`~admm_dist.model.loading`: a backbone from a folder or a hub id, checked first;
- :mod:`~admm_dist.model.adapter`: the flat B vector that ADMM agrees on and the PEFT export;
- :mod:`~admm_dist.model.fused_lora`: the fused B-only LoRA linear the adapter's layers run;
- :mod:`~admm_dist.model.vectors`: B-vector files (safetensors with the adapter's identity),
  the cross-rank basis checks and :class:`~admm_dist.model.vectors.AdapterError`;
- :mod:`~admm_dist.model.batches`: tokenisation, per-token masks and right-padded batches;
- :mod:`~admm_dist.model.objectives`: per-token log-probs, the reference and the
  DPO/SFT/RSFT losses;
- :mod:`~admm_dist.model.pretrained`: SmolLM2-135M-Instruct built offline from its wheel.

Imports: :mod:`admm_dist.core` and :mod:`admm_dist.engine`.
"""
