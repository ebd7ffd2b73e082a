"""The one rule that ends a decoded sequence: its first stop token (the model's end of sequence unless a run says
otherwise). The decode loop checks it after every token (:mod:`kvlab.engine.decoding`), and the result keeps each
sequence up to and including it."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvlab.models.loading import LoadedModel


def eos_token_ids(loaded: LoadedModel) -> tuple[int, ...]:
    """The model's end-of-sequence ids from its generation config (one id, a list, or none)."""
    eos = getattr(loaded.model.generation_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


class StopTokens:
    """The tokens that end a sequence, and which sequences of a batch have ended so far."""

    def __init__(self, token_ids: Iterable[int], batch_size: int) -> None:
        self.ids = set(token_ids)
        self.finished = torch.zeros(batch_size, dtype=torch.bool)

    def all_finished(self, tokens: list[int]) -> bool:
        """Note the batch's latest tokens; whether every sequence has now met a stop token."""
        self.finished |= torch.tensor([token in self.ids for token in tokens])
        return bool(self.finished.all())

    def trim(self, tokens: list[int]) -> list[int]:
        """Tokens up to and including the first stop token."""
        for index, token in enumerate(tokens):
            if token in self.ids:
                return tokens[: index + 1]
        return tokens
