"""Expected Attention: keep the tokens the queries still to come are expected to attend to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.cache.ranking import KEEP
from kvlab.errors import KvlabError
from kvlab.params import param
from kvlab.policies.base import LayerView
from kvlab.policies.scoring import ScoringPolicy


@dataclass
class ExpectedAttention(ScoringPolicy):
    """Expected Attention (Devoto et al., "Expected Attention: KV Cache Compression by Estimating Attention from
    Future Queries Distribution", arXiv:2510.00636): the queries still to come are modelled as a Gaussian with the
    mean and covariance of the queries seen so far (before RoPE), rotated by RoPE's rotation averaged over the next
    ``n_future_positions`` positions. A key's expected attention logit is then closed-form,
    ``E[exp(s q.k)] = exp(s mu.k + s^2 k^T Sigma k / 2)``; it is softmaxed over the held keys, averaged over the query
    heads of each KV head and multiplied by the value's norm (``(a + epsilon) x ||v||``, ``use_vnorm``), since a
    token contributes attention times value to the output. The first ``n_sink`` positions are always kept.

    Differs from kvpress's ``ExpectedAttentionPress`` (0.5.5), which the defaults follow: ``s`` is the model's own
    attention scaling (``1/sqrt(head_dim)`` where kvpress assumes it; Gemma 2 scales by its
    ``query_pre_attn_scalar``), and soft-capped logits are modelled without the cap. The query moments are those of
    every query seen from position 4 on (kvpress leaves out the first ``n_sink`` of the prompt's queries: the same at
    the default), kept as running sums, so in ``streaming`` mode, which kvpress does not have, each eviction models
    the future from every query so far, the decoded ones included, rotated to the ``n_future_positions`` positions
    from the next token's on; before any such query is seen the expected attention is uniform and the values' norms
    decide. The softmax leaves out the sinks and the free slots, as kvpress leaves out its first ``n_sink`` keys. It
    needs the model's rotary embedding, which kvlab finds on transformers' RoPE models.
    """

    name: ClassVar[str] = "expected_attention"
    needs_query_moments: ClassVar[bool] = True
    n_future_positions: int = param(512, minimum=1, help="future positions the RoPE rotation is averaged over")
    n_sink: int = param(4, minimum=0, help="first tokens always kept (attention sinks)")
    use_covariance: bool = param(True, help="model the queries' spread (covariance), not only their mean")
    use_vnorm: bool = param(True, help="weigh the expected attention by the value's L2 norm")
    epsilon: float = param(0.0, minimum=0.0, help="added to the expected attention before weighing by the value norm")

    def min_budget(self) -> int:
        return self.n_sink + 1

    def describe_min_budget(self) -> str:
        return f"its {self.n_sink} sinks plus one token"

    def score(self, view: LayerView) -> torch.Tensor:
        moments = view.query_moments()
        if moments is None or view.rope is None:
            raise KvlabError(
                f"Policy {self.name!r} models future queries through the model's rotary embedding, which kvlab "
                "cannot find in this model; choose another policy."
            )
        mean, covariance, _ = moments
        keys = view.keys
        future = view.next_position + torch.arange(self.n_future_positions, device=keys.device)
        rotation = view.rope.mean_rotation(future, keys.shape[-1])
        positions = view.positions
        scores = expected_attention(
            keys,
            view.cache.slots(view.span)[1] if self.use_vnorm else None,
            rotation @ mean.unsqueeze(-1),
            rotation @ covariance @ rotation.T if self.use_covariance else None,
            view.cache.scaling,
            attended=(positions >= self.n_sink),
            epsilon=self.epsilon,
        )
        return scores.masked_fill(positions < self.n_sink, KEEP)


def expected_attention(
    keys: torch.Tensor,
    values: torch.Tensor | None,
    mean: torch.Tensor,
    covariance: torch.Tensor | None,
    scaling: float,
    attended: torch.Tensor,
    epsilon: float = 0.0,
) -> torch.Tensor:
    """Expected attention per slot, ``(batch, kv_heads, slots)``: for future queries ``q ~ N(mean, covariance)``
    (``(batch, q_heads, head_dim, 1)`` and ``(batch, q_heads, head_dim, head_dim)``, already at the future positions;
    no covariance: the mean alone), the logit ``s mean.k + s^2 k^T covariance k / 2``, softmaxed over the
    ``attended`` slots (zero elsewhere), averaged over the query heads of each KV head, then ``(a + epsilon) x ||v||``
    where ``values`` are given."""
    batch, kv_heads, slots, head_dim = keys.shape
    groups = mean.shape[1] // kv_heads
    grouped = keys.float().unsqueeze(2)  # (batch, kv_heads, 1, slots, head_dim), shared by the group's query heads
    logits = scaling * (grouped @ mean.view(batch, kv_heads, groups, head_dim, 1)).squeeze(-1)
    if covariance is not None:
        spread = grouped @ covariance.view(batch, kv_heads, groups, head_dim, head_dim)
        logits = logits + scaling**2 / 2 * (spread * grouped).sum(dim=-1)
    logits = logits.masked_fill(~attended.unsqueeze(2), float("-inf"))
    scores = torch.softmax(logits, dim=-1).mean(dim=2)
    if values is None:
        return scores
    return (scores + epsilon) * values.float().norm(dim=-1)
