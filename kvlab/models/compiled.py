"""The model's decoder layers compiled (``torch.compile``) for the fused decode steps of the ``flex`` backend.

A decode step of one token reads the weights once, and everything between the matrix products (the norms in float32,
the rotary embedding, the gated activation, the residual additions) is a few dozen tiny kernels per layer: over 32
layers they cost milliseconds of launches even when the step is replayed from a CUDA graph. Compiled, each stretch
between two matrix products becomes one fused kernel.

Only the model's own arithmetic is compiled. The heap's ``update`` and kvlab's attention function are Python over
the heap's state (slots, positions, what the policy observes); they are marked ``torch.compiler.disable``, so each
layer compiles into the stretch before the cache write, the stretch after the attention, and nothing of kvlab. The
graphs are the same for every layer (a layer's index is not specialised on), so a model compiles once per shape.

Compiled code runs only where asked (:func:`layer_stance`): the static decode steps of the ``flex`` backend, whose
shapes never change. Every other forward (prefill chunks, eager steps, another backend, and anything a user runs on
the model outside kvlab) runs the layers eagerly, as it did before they were compiled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._dynamo

from kvlab.models.packed import Swap, pack_layer, packs_in_place

#: Set on a model once its layers are compiled.
COMPILED = "_kvlab_compiled_layers"
#: A layer's compiled forward, kept beside the layer's own until a fused forward swaps it in.
COMPILED_FORWARD = "_kvlab_compiled_forward"
#: A layer's packed projections (:class:`kvlab.models.packed.Swap`), put in place for fused forwards only.
PACKED_PROJECTIONS = "_kvlab_packed_projections"
#: Inductor's mode for the layers: each matrix product's kernel chosen by timing Triton's templates against cuBLAS
#: once per shape, which made decode steps 3-8% faster on an H200 at 8k and 32k
#: (``bench/results/heap_gpu/autotuned_decode_h200.json``); without Inductor's own CUDA graphs, since the static
#: steps capture theirs.
LAYER_MODE = "max-autotune-no-cudagraphs"


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The decoder layers of a transformers causal LM (``model.get_decoder().layers``), or none where it has no such
    list."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


def compile_layers(model: Any, backend: str | Callable[..., Any] = "inductor") -> bool:
    """Compile ``model``'s decoder layers for fixed shapes (once per model; ``backend`` is torch.compile's). Whether
    they are compiled now.

    The compiled forward is kept beside each layer's own, not installed in its place: the model stays the user's
    model, so that anything run on it outside a fused step (``model.generate``, a forward of another length) runs
    eagerly as before, rather than compiling again for every new length until Dynamo gives up."""
    if compiled(model):
        return True
    layers = decoder_layers(model)
    if not layers:
        return False
    for layer in layers:
        setattr(layer, PACKED_PROJECTIONS, pack_layer(layer))
        mode = LAYER_MODE if backend == "inductor" else None  # another backend takes no Inductor mode
        setattr(layer, COMPILED_FORWARD, torch.compile(layer.forward, backend=backend, dynamic=False, mode=mode))
    setattr(model, COMPILED, True)
    return True


def compiled(model: Any) -> bool:
    """Whether ``model``'s layers were compiled by :func:`compile_layers`."""
    return bool(getattr(model, COMPILED, False))


@contextlib.contextmanager
def layer_stance(model: Any, fused: bool) -> Iterator[None]:
    """Run ``model``'s forward with its compiled layers and packed projections where ``fused`` (a static decode step
    of the ``flex`` backend), eagerly otherwise; nothing changes for a model whose layers were never compiled. Fused
    forwards treat a layer's integer attributes (its index) as inputs, so the 32 layers of a model share one compiled
    graph."""
    if not (fused and compiled(model)):
        yield
        return
    layers = decoder_layers(model)
    swaps: tuple[Swap, ...] = sum((getattr(layer, PACKED_PROJECTIONS, ()) for layer in layers), ())
    with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True), packs_in_place(swaps):
        for layer in layers:
            layer.forward = getattr(layer, COMPILED_FORWARD)
        try:
            yield
        finally:
            for layer in layers:
                del layer.forward  # the class's own forward again
