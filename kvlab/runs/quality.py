"""Quality beyond needles: how well a model still predicts a held-out text when its cache is evicted.

A needle asks whether one fact survives; a text pass asks what eviction costs everywhere. One pass reads a short
prefix of the text, then feeds the rest one token at a time as if the model had generated it (teacher forcing:
:class:`~kvlab.engine.generation.Generation` with ``forced_ids``), the cache evicting as it does while generating. Every
step scores the text's next token under the policy's cache, as a negative log-likelihood (perplexity is the exponential
of their mean), and compares the policy's whole next-token distribution with the full cache's, as
KL(P_full || P_policy) in nats, averaged over the steps.

The full cache's distributions come from a second generation of the same engine over the same tokens, stepped in
lockstep with the policy's and differing from it only in the policy (same mode, chunk, heap layout and dtype): the
full cache therefore scores a KL of exactly 0, and its perplexity is the model's own loss on those tokens. The two
caches are held at once, so no distribution over the vocabulary is kept beyond the step that uses it; the price is
that the device's peak allocation covers both, and is not recorded as the policy's.

What a pass reads, its lengths and the checks that need no model are in :mod:`kvlab.tasks.texts`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvlab.engine.events import GenerationResult
from kvlab.engine.generation import Generation
from kvlab.engine.spec import RunSpec
from kvlab.errors import shown_name
from kvlab.models.loading import LoadedModel
from kvlab.policies.full import Full
from kvlab.runs.records import held_and_timed, run_config
from kvlab.store import Store, Trial
from kvlab.tasks.needle import HAYSTACK_DIR
from kvlab.tasks.texts import TextPass, text_pass, token_budget

#: The held-out text a pass reads unless told otherwise: Python documentation prose that the shipped model never
#: trained on (``kvlab/data/haystacks/README.md``).
DEFAULT_TEXT = HAYSTACK_DIR / "python-docs-1.txt"


@dataclass(frozen=True)
class Quality:
    """What one pass measured. ``nll`` is the mean negative log-likelihood of the scored tokens under the policy's
    cache and ``full_nll`` under the full cache (nats per token; perplexity is their exponential); ``kl`` is the mean
    over steps of KL(P_full || P_policy) in nats. ``result`` is the policy's generation: its kept tokens, KV bytes
    measured from the cache tensors, and seconds."""

    scored_tokens: int
    nll: float
    kl: float
    full_nll: float
    result: GenerationResult

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)

    @property
    def full_perplexity(self) -> float:
        return math.exp(self.full_nll)

    def to_json(self) -> dict[str, Any]:
        """The figures as one JSON object (the command line's ``--json``, the sink ablation's summary)."""
        result = self.result
        return {
            "scored_tokens": self.scored_tokens,
            "perplexity": self.perplexity,
            "nll": self.nll,
            "kl": self.kl,
            "full_perplexity": self.full_perplexity,
            "full_nll": self.full_nll,
            "perplexity_ratio": self.perplexity / self.full_perplexity,
            "kept_tokens": result.mean_kept_tokens,
            **{
                name: getattr(result, name)
                for name in (
                    "kept_per_layer",
                    "kv_bytes",
                    "kv_bytes_full",
                    "peak_kv_bytes",
                    "kv_reserved_bytes",
                    "peak_kv_reserved_bytes",
                    "compactions",
                    "prefill_seconds",
                    "decode_seconds",
                    "device",
                    "dtype",
                    "layout",
                )
            },
        }


def model_pass(loaded: LoadedModel, text: str, name: str, prefix: int, scored: int) -> TextPass:
    """A pass over ``text`` as ``loaded`` reads it (:func:`~kvlab.tasks.texts.text_pass`), refused in one sentence
    before the text is tokenised when it is longer than the model's positions (or the operator's limits)."""
    loaded.limits.check(prefix, scored, shown_name(loaded.name))
    return text_pass(loaded.tokenizer, text, name, prefix, scored)


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities, in float32 whatever the model's dtype."""
    return torch.log_softmax(logits.float(), dim=-1)


def nll(log_p: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The negative log-likelihood of each sequence's target token, ``(batch,)``."""
    return -log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def kl(log_reference: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """KL(reference || p) per sequence in nats, ``(batch,)``: exactly 0 where the two are the same."""
    return (log_reference.exp() * (log_reference - log_p)).sum(-1)


def predictions(generation: Generation) -> Iterator[torch.Tensor]:
    """The logits that predicted each decoded (here: forced) token of a generation, in order. A decode event carries
    the logits its step computed, which predict the next token; the first token is predicted by the prompt's."""
    latest = None
    for event in generation.events():
        if event.kind == "decode":
            assert latest is not None
            yield latest
        if event.logits is not None:
            latest = event.logits


def measure(loaded: LoadedModel, spec: RunSpec, text: TextPass) -> Quality:
    """Read ``text`` under ``spec``'s policy and, in lockstep, under the full cache (the same spec otherwise), and
    score every token after the prefix (see the module's description). The spec's generation length and stop
    tokens are the pass's own."""
    token_budget(spec.budget)
    spec = pass_spec(spec, text)
    ids = torch.tensor([text.ids])
    prompt, forced = ids[:, : text.prefix], ids[:, text.prefix :]
    generation = Generation(loaded, spec, prompt, forced_ids=forced)
    reference = Generation(loaded, dataclasses.replace(spec, policy=Full(), budget=None), prompt, forced_ids=forced)
    targets = forced.to(loaded.device)
    nlls, kls, full_nlls = [], [], []
    with torch.inference_mode():  # both generations' own inference mode is entered and left interleaved
        steps = zip(predictions(generation), predictions(reference), strict=True)
        for index, (logits, full_logits) in enumerate(steps):
            log_p, log_full = log_probs(logits), log_probs(full_logits)
            nlls.append(nll(log_p, targets[:, index]))
            full_nlls.append(nll(log_full, targets[:, index]))
            kls.append(kl(log_full, log_p))
    return Quality(
        scored_tokens=text.scored,
        nll=_mean(nlls),
        kl=_mean(kls),
        full_nll=_mean(full_nlls),
        result=generation.result(),
    )


def pass_spec(spec: RunSpec, text: TextPass) -> RunSpec:
    """``spec`` set to feed the pass's scored tokens: as many decode steps, no stop tokens."""
    return dataclasses.replace(spec, max_new_tokens=text.scored, stop_token_ids=())


def run_quality(
    loaded: LoadedModel, spec: RunSpec, text: TextPass, store: Store | None = None
) -> tuple[Quality, int | None]:
    """Measure a pass and, with a ``store``, file it as a run with one trial (the same settings on the same tokens
    are the same run: a second pass adds no trial); returns the measurement and the run's id. A text is read as the
    tokenizer reads it, whatever the BOS rule (its ids are part of the task's hash), so the rule is left out of the
    run's identity, as it was before the rule could be chosen."""
    if store is None:
        return measure(loaded, spec, text), None
    config = run_config(
        loaded,
        pass_spec(spec, text),
        task=text.task,
        task_hash=text.content_hash(),
        stop_rule="none",
        query_aware=None,
        context_length=len(text.ids),
    )
    run_id = store.begin_run(dataclasses.replace(config, bos=None))
    finished = False
    try:
        quality = measure(loaded, spec, text)
        store.add_trial(run_id, text_trial(text, quality))
        finished = True
    finally:
        store.finish_run(run_id, "finished" if finished else "interrupted")
    return quality, run_id


def _mean(values: list[torch.Tensor]) -> float:
    """The mean of per-step values over steps and sequences, in float64."""
    return float(torch.stack(values).double().mean())


def text_trial(text: TextPass, quality: Quality) -> Trial:
    """The one trial of a pass over a text: no answer to score (``correct`` is NULL), but the tokens it scored,
    their mean negative log-likelihood and mean KL from the full cache, with the policy's kept tokens, KV bytes and
    seconds. The peak GPU allocation is left out: the full cache's generation ran beside the policy's on the same
    device, so the device's peak is theirs together."""
    return Trial(
        trial_key=text.name,
        task_id=text.name,
        context_tokens=len(text.ids),
        correct=None,
        item_hash=text.content_hash(),
        **held_and_timed(quality.result),
        scored_tokens=quality.scored_tokens,
        nll=quality.nll,
        kl=quality.kl,
    )
