"""Models: what kvlab runs on, found, loaded and described.

:mod:`~kvlab.models.arch` (the architecture's facts from a config), :mod:`~kvlab.models.limits` (how long a prompt
may be), :mod:`~kvlab.models.catalog` (the models on this machine), :mod:`~kvlab.models.gguf` (GGUF checkpoints),
:mod:`~kvlab.models.loading` (loading a model and its tokenizer on one device or split over several) and
:mod:`~kvlab.models.rope` (the model's rotary embedding as policies need it). The package knows nothing of the cache
or of attention: the engine switches a loaded model to kvlab's attention when a run starts.
"""
