"""The fused B-only LoRA linear: the forward and backward the x-step runs on every LoRA layer.

Why it exists: PEFT's generic LoRA forward builds three autograd nodes per wrapped projection
(``lora_A``, ``lora_B``, the scaled add) and keeps each one's input for the backward, although
here W, its bias and every A are frozen and only B trains. :class:`BOnlyLinearFn` does the
layer in one autograd op that saves only what the two gradients it returns (for the input and
for B) need, which makes the x-step's local steps faster and lighter on memory
(docs/archive/benchmarks-notebook.md, "Where the step time goes").

:func:`install_fused_forward` routes one PEFT ``LoraLayer``'s forward through it;
:class:`~admm_dist.model.adapter.BOnlyLoRA` installs it on every layer it wraps unless built
with ``fast_path=False``. It computes what PEFT's forward computes (``tests/model/test_adapter.py``
compares the two).
"""
from __future__ import annotations

import torch


class BOnlyLinearFn(torch.autograd.Function):
    """y = x W^T + b + s (x A^T) B^T with W, b and A frozen: one op, gradients for x and B only.

    PEFT's generic LoRA forward builds three autograd nodes per layer (A, B, the scaled
    add) and keeps their inputs. Here, in fp32, W + s B A is formed once (out x in, r
    multiply-adds per entry) and used for both passes; with a lower-precision base (bf16 on
    GPU) the base product stays in its dtype and only the rank-r path runs in fp32, as in
    PEFT. The backward returns dL/dx and dL/dB = s g^T (x A^T); nothing else.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scale):
        xa = torch.nn.functional.linear(x.to(a.dtype), a)             # [..., r]
        if weight.dtype == a.dtype and x.dtype == a.dtype:
            w_eff = torch.addmm(weight, b, a, alpha=scale)          # W + s B A
            y = torch.nn.functional.linear(x, w_eff, bias)
            ctx.save_for_backward(w_eff, xa, a, b)
            ctx.merged = True
        else:
            base = torch.nn.functional.linear(x, weight, bias)
            out = base.shape[-1]
            y = torch.addmm(base.reshape(-1, out).to(a.dtype), xa.reshape(-1, xa.shape[-1]), b.t(),
                            alpha=scale).reshape(base.shape).to(base.dtype)
            ctx.save_for_backward(weight, xa, a, b)
            ctx.merged = False
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, g):
        w, xa, a, b = ctx.saved_tensors
        s = ctx.scale
        gx = gb = None
        out, r = b.shape
        if ctx.needs_input_grad[0]:
            if ctx.merged:
                gx = g @ w
            else:
                gx = (g @ w) + (s * ((g.to(b.dtype) @ b) @ a)).to(g.dtype)
        if ctx.needs_input_grad[4]:
            gb = s * (g.reshape(-1, out).to(b.dtype).t() @ xa.reshape(-1, r))
        return gx, None, None, None, gb, None


def install_fused_forward(layer, adapter_name: str) -> None:
    """Route the layer's enabled-adapter forward through :class:`BOnlyLinearFn`.

    Anything else (adapters disabled, merged weights, mixed adapter batches, extra
    arguments, dropout) keeps PEFT's own forward.
    """
    generic = layer.forward

    def forward(x, *args, **kwargs):
        if (args or kwargs or layer.disable_adapters or layer.merged
                or adapter_name not in layer.active_adapters
                or not isinstance(layer.lora_dropout[adapter_name], torch.nn.Identity)):
            return generic(x, *args, **kwargs)
        base = layer.base_layer
        return BOnlyLinearFn.apply(x, base.weight, base.bias, layer.lora_A[adapter_name].weight,
                                   layer.lora_B[adapter_name].weight, layer.scaling[adapter_name])

    layer.forward = forward
