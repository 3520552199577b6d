"""Regional compilation (`model.compile_layers`, issue 46): each decoder layer through `torch.compile`, one compiled
layer reused by all of them.

In eager mode a layer runs its RoPE with fp32 temporaries, RMSNorm as several kernels, SiLU·up and autocast's casts
each on their own: memory traffic and launches a compiler fuses. Compiling the layer rather than the model keeps the
compile to one layer's graph (dynamo guards on the layer's code, not on which layer: the 18 or 28 share it) and leaves
outside it what compiles badly: the scoring LM head, the loss, the trainer. Shapes are dynamic from the start, so a
packed row of a new length reuses the graph instead of recompiling.

Inside a layer: `packed_varlen` (PyTorch's varlen attention, a custom op) and flash-attn take the sample bounds as
tensors and the longest sample as a number the collator computed, so attention compiles with the rest; per-sample
sdpa (`packed_sdpa`, CPU) loops over the samples and stays eager, a break in the middle of each layer. The MoE's
routed experts under split expert LoRA or in 4-bit (model/grouped.py) run eagerly the same way.
"""

from __future__ import annotations

from erniekit_lite.model.lora import unwrap


def decoder_layers(model) -> list:
    base = unwrap(model)
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base.model
    return list(decoder.layers)


def compile_layers(model, backend: str | None = None) -> int:
    """Compile every decoder layer of `model` in place (`nn.Module.compile`); returns how many."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(backend=backend or "inductor", dynamic=True)
    return len(layers)


def describe(on: bool, backend: str | None) -> str:
    """The plan's and the run's line: on or off (model.compile_layers), and why."""
    if on:
        return (f"compile: each decoder layer through torch.compile (backend {backend or 'inductor'}, dynamic row "
                "length; model.compile_layers)")
    return "compile: off (model.compile_layers; off by default until a GPU measurement shows compiled layers faster)"
