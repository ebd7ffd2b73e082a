"""Value norm: keep the tokens whose value vectors have the largest L2 norm.

The example policy of the guide "Write a policy". A token's contribution to a layer's attention output is its
attention weight times its value vector, so a token with a small value moves the output little wherever attention
puts it: value norm evicts those first. Like Knorm it reads no attention at all.
"""

# --8<-- [start:policy]
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.cache.ranking import KEEP
from kvlab.params import param
from kvlab.policies import register_policy
from kvlab.policies.base import LayerView
from kvlab.policies.scoring import ScoringPolicy


@register_policy
@dataclass
class ValueNorm(ScoringPolicy):
    """Value-norm eviction: the tokens whose values have the largest L2 norm are kept, and the first ``sinks`` tokens
    always are. Not from a paper: the example policy of the guide "Write a policy"."""

    #: The name the registry, the command line (``--policy value_norm``) and stored runs know it by.
    name: ClassVar[str] = "value_norm"
    #: What it observes: no accumulated attention (H2O sets ``needs_scores = True`` and reads ``view.scores``) ...
    needs_scores: ClassVar[bool] = False

    sinks: int = param(4, minimum=0, maximum=1024, help="first tokens always kept (attention sinks)")

    def query_window(self) -> int:
        """... and no window of recent queries (TOVA remembers 1 and reads ``view.window_attention()``)."""
        return 0

    def min_budget(self) -> int:
        return self.sinks + 1

    def describe_min_budget(self) -> str:
        return f"its {self.sinks} sinks plus at least one token ranked by its value"

    def score(self, view: LayerView) -> torch.Tensor:
        """One score per slot and KV head, ``(batch, kv_heads, span)``: the value's L2 norm; the sinks at ``KEEP``."""
        _, values, positions = view.cache.slots(view.span)  # values: (batch, kv_heads, span, head_dim)
        scores = values.float().norm(dim=-1)
        sinks = (positions >= 0) & (positions < self.sinks)  # free slots have negative positions
        return scores.masked_fill(sinks, KEEP)


# --8<-- [end:policy]
