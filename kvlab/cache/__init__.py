"""The KV cache: where keys and values live, how eviction frees their slots, and how the kept ones are stored.

The heap (:mod:`~kvlab.cache.heap`) holds each layer's slots; its layout (:mod:`~kvlab.cache.layouts`) decides what
becomes of evicted slots. Everything else that changes how the cache stores what a policy keeps is a cache option,
described once in :mod:`~kvlab.cache.spec` (torch-free) and built into the heap's layers: precision tiers
(:mod:`~kvlab.cache.tiers`, :mod:`~kvlab.cache.quant`), demotion to CPU memory and disk
(:mod:`~kvlab.cache.demotion`, :mod:`~kvlab.cache.offload`), layer allocations and scopes
(:mod:`~kvlab.cache.allocation`, :mod:`~kvlab.cache.scopes`) and the noise floor (:mod:`~kvlab.cache.noise`).
:mod:`~kvlab.cache.sparse` holds the maths of sparse reads over a layer's slots. Nothing here imports a policy, an
attention function or a model loader.
"""
