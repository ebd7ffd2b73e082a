"""The attention backends a run can decode with, named and described once, without loading torch.

A decode step attends one query to the whole heap. kvlab's own kernels (``sdpa``: SDPA where slots are in order, one
query's attention written out as matrix products where they are not) are exact and observable, but a static step over
a heap with free slots then runs q.K^T, a softmax and a one-row P.V per layer, each bound by latency. ``flex`` runs a
static step's attention as PyTorch's ``flex_attention`` (a fused split-K decode kernel on CUDA) over a block mask built
from the heap's occupied slot blocks; what a policy observes of the step (H2O's accumulated attention) comes from the
kernel's log-sum-exp; on CUDA the model's decoder layers are compiled around it (:mod:`kvlab.models.compiled`), so
the whole step is fused kernels. A prefill chunk in streaming mode, which SDPA would need a mask for, is a
``flex_attention`` call too (:mod:`kvlab.attention.flex_chunks`). ``auto`` picks ``flex`` where it is compiled
(CUDA with Triton) and ``sdpa`` elsewhere.

The command line's ``--attention``, :class:`kvlab.engine.spec.RunSpec`'s ``attention`` and a stored run's
``attention`` column spell the backends from here.
"""

from __future__ import annotations

from typing import Final, Literal

from kvlab.errors import KvlabError

AttentionBackend = Literal["auto", "flex", "sdpa"]
#: The backend chosen for the device: ``flex`` where it is compiled, ``sdpa`` elsewhere.
AUTO: Final = "auto"
#: ``flex_attention`` over the heap's occupied slot blocks in static decode steps and streaming-mode prefill chunks.
FLEX: Final = "flex"
#: kvlab's own kernels everywhere (every run stored before the choice existed decoded with them).
SDPA: Final = "sdpa"
ATTENTION_BACKENDS: tuple[AttentionBackend, ...] = (AUTO, FLEX, SDPA)
DEFAULT_ATTENTION: AttentionBackend = AUTO
#: The backends in one sentence, for the command line's and the dashboard's help.
ATTENTION_HELP = (
    "How static decode steps and streaming-mode prefill chunks attend over the heap. flex: PyTorch's flex_attention "
    "(compiled on CUDA) over a block "
    "mask of the occupied slot blocks, observing through its log-sum-exp, the model's layers compiled around it. "
    "sdpa: kvlab's own kernels (SDPA, or the query's attention as matrix products where slots are free), the layers "
    "eager. auto: flex on CUDA with Triton, else sdpa."
)


def check_attention(name: str) -> AttentionBackend:
    """``name`` as an :data:`AttentionBackend`; any other name is one sentence."""
    for backend in ATTENTION_BACKENDS:
        if name == backend:
            return backend
    raise KvlabError(f"Unknown attention backend {name!r}; use one of {', '.join(ATTENTION_BACKENDS)}.")


def resolve_attention(name: AttentionBackend, device_type: str, flex_compiles: bool) -> AttentionBackend:
    """The backend a run on a ``device_type`` device decodes with: ``auto`` is ``flex`` where ``flex_compiles`` (CUDA
    with Triton, where the fused kernel exists) and ``sdpa`` elsewhere; a named backend is itself (``flex`` on a CPU
    runs PyTorch's reference implementation: exact, slow, for checking)."""
    if name != AUTO:
        return name
    return FLEX if device_type == "cuda" and flex_compiles else SDPA


def stored_attention(resolved: AttentionBackend) -> str | None:
    """The backend as a run's identity stores it: ``None`` for ``sdpa``, which every run stored before the choice
    existed used, so that their identities stay what they were."""
    return None if resolved == SDPA else resolved
