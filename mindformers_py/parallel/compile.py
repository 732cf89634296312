"""``torch.compile`` of each repeated layer (torchtitan's way), shared by every engine.

Compiling the transformer layers one by one rather than the whole model keeps the model itself a plain module (its
``save_pretrained``, hooks, task heads and pipeline cuts see no wrapper), avoids graph breaks from the model's
Python (masks, caches, output classes), and costs one compilation for the whole stack: the layers run the same code
on parameters of the same shapes, so the graph compiled for the first one serves the others (dynamo treats module
parameters as inputs). Within a layer inductor fuses the memory-bound work between the matrix products (norms,
activations, residual adds, dropout, dtype casts under autocast), which in bf16 is most of a small model's step.

The compiled kernels are also kept on disk by inductor's FX graph cache, so a later run of the same model shape
compiles in seconds rather than tens of seconds.
"""

from __future__ import annotations

from torch import nn

from .data import layer_modules


def compile_layers(model: nn.Module, mode: str | None = None, backend: str = "inductor") -> list[nn.Module]:
    """``torch.compile`` each of ``model``'s repeated layers in place (``nn.Module.compile``; ``mode`` and
    ``backend`` as ``torch.compile`` takes them); returns the layers compiled (empty when the model declares
    none)."""
    layers = layer_modules(model)
    for layer in layers:
        layer.compile(mode=mode, backend=backend)
    return layers
