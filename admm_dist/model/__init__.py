"""The model layer: a backbone, the B-only LoRA adapter on it, and the training objectives.

- :mod:`~admm_dist.model.loading`: a backbone from a folder or a hub id, checked first;
- :mod:`~admm_dist.model.adapter`: the flat B vector that ADMM agrees on, its fused forward,
  its files (safetensors with identity) and the PEFT export;
- :mod:`~admm_dist.model.objectives`: tokenisation, batches and the DPO/SFT/RSFT losses;
- :mod:`~admm_dist.model.pretrained`: SmolLM2-135M-Instruct built offline from its wheel.

Imports: :mod:`admm_dist.core` and :mod:`admm_dist.engine`.
"""
