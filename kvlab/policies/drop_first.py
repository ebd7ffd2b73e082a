"""The first-token ablation: the full cache with only its first token removed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.policies.base import LayerView, Policy


@dataclass
class DropFirst(Policy):
    """An ablation, not a method: the full cache with only its first token removed, to measure what that one token
    (the attention sink of StreamingLLM, Xiao et al., arXiv:2309.17453, section 3.1) is worth on its own, beside
    StreamingLLM with 0, 1, 4, ... sinks. It takes no budget: it keeps every other token, as the full cache does.

    The first token is removed at the first eviction after it was read, like any evicted token: after the first
    chunk in streaming mode (the tokens of that chunk were read with it in view), at the one compression in prefill
    mode. Sliding-window layers still drop what their window can no longer see.
    """

    name: ClassVar[str] = "drop_first"
    evicts: ClassVar[bool] = False

    def removes(self) -> int:
        return 1

    def removed(self, view: LayerView) -> torch.Tensor:
        return view.positions == 0
