"""The model's decoder layers compiled (``torch.compile``) for the fused decode steps and prefill chunks of the
``flex`` backend.

A decode step of one token reads the weights once, and everything between the matrix products (the norms in float32,
the rotary embedding, the gated activation, the residual additions) is a few dozen tiny kernels per layer: over 32
layers they cost milliseconds of launches even when the step is replayed from a CUDA graph. Compiled, each stretch
between two matrix products becomes one fused kernel. A prefill chunk of thousands of tokens has the same stretches,
each a pass over the chunk's activations: unfused, they were about a fifth of a streaming prefill's GPU time on an
H200 (``bench/results/heap_gpu/long_profile_64k_h200.json``).

Only the model's own arithmetic is compiled. The heap's ``update`` and kvlab's attention function are Python over
the heap's state (slots, positions, what the policy observes); they are marked ``torch.compiler.disable``, so each
layer compiles into the stretch before the cache write, the stretch after the attention, and nothing of kvlab. The
graphs are the same for every layer (a layer's index is not specialised on), so a model compiles once per shape.

Compiled code runs only where asked (:func:`layer_stance`), at shapes that repeat: the static decode steps of the
``flex`` backend (:data:`STEP`), and under that backend the full chunks of a context read in several
(:data:`CHUNK`; the last, shorter chunk runs eagerly, so that no prompt length compiles anew). Every other forward
(a context read in one pass, eager steps, another backend, and anything a user runs on the model outside kvlab) runs
the layers eagerly, as it did before they were compiled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch._dynamo

from kvlab.models.packed import Swap, pack_layer, packs_in_place

#: Set on a model once its layers are compiled.
COMPILED = "_kvlab_compiled_layers"
#: The layers' forwards a pass can run: their own (``eager``), compiled for a static decode step (``step``) or for a
#: prefill chunk (``chunk``).
LayerForward = Literal["eager", "step", "chunk"]
EAGER: LayerForward = "eager"
STEP: LayerForward = "step"
CHUNK: LayerForward = "chunk"
#: Where a layer keeps each compiled forward, beside its own, until a fused pass swaps it in.
COMPILED_FORWARDS: dict[LayerForward, str] = {STEP: "_kvlab_compiled_forward", CHUNK: "_kvlab_compiled_chunk_forward"}
#: A layer's packed projections (:class:`kvlab.models.packed.Swap`), put in place for fused forwards only.
PACKED_PROJECTIONS = "_kvlab_packed_projections"
#: Inductor's mode for the layers: each matrix product's kernel chosen by timing Triton's templates against cuBLAS
#: once per shape, which made decode steps 3-8% faster on an H200 at 8k and 32k
#: (``bench/results/heap_gpu/autotuned_decode_h200.json``); without Inductor's own CUDA graphs, since the static
#: steps capture theirs.
LAYER_MODE = "max-autotune-no-cudagraphs"
#: Inductor's mode for a prefill chunk's layers: its default. Timing the products' templates for a chunk's shapes
#: too would add to a run's first compilation (for a step's, 22 s at 8k on an H200), and a chunk's products of
#: thousands of rows are not the latency-bound ones of a one-token step that autotuning sped up.
CHUNK_MODE: str | None = None


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
    modes = {STEP: LAYER_MODE, CHUNK: CHUNK_MODE}
    for layer in layers:
        setattr(layer, PACKED_PROJECTIONS, pack_layer(layer))
        for forward, attribute in COMPILED_FORWARDS.items():
            mode = modes[forward] if backend == "inductor" else None  # another backend takes no Inductor mode
            # a step's shapes are fixed; a chunk's keys grow as the heap fills and its layer index is an input: left
            # to Dynamo, each compiles once more with them dynamic rather than once per key length and layer
            dynamic = False if forward == STEP else None
            setattr(layer, attribute, torch.compile(layer.forward, backend=backend, dynamic=dynamic, mode=mode))
    setattr(model, COMPILED, True)
    return True


def compiled(model: Any) -> bool:
    """Whether ``model``'s layers were compiled by :func:`compile_layers`."""
    return bool(getattr(model, COMPILED, False))


@contextlib.contextmanager
def layer_stance(model: Any, forward: LayerForward) -> Iterator[None]:
    """Run ``model``'s forward with its layers compiled for ``forward`` (a static decode step of the ``flex`` backend,
    or a full prefill chunk under it) and their packed projections, or eagerly (``eager``); nothing changes for a
    model whose layers were never compiled. Fused forwards treat a layer's integer attributes (its index) as inputs,
    so the 32 layers of a model share one compiled graph."""
    if forward == EAGER or not compiled(model):
        yield
        return
    layers = decoder_layers(model)
    swaps: tuple[Swap, ...] = sum((getattr(layer, PACKED_PROJECTIONS, ()) for layer in layers), ())
    with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True), packs_in_place(swaps):
        for layer in layers:
            layer.forward = getattr(layer, COMPILED_FORWARDS[forward])
        try:
            yield
        finally:
            for layer in layers:
                del layer.forward  # the class's own forward again
