"""Claims measured on attention profiles (claims 11 and 29): per layer, the share of attention on the first token
and the attention entropy, from the JSON files ``bench/attention_profile.py`` writes into the benchmark results."""

from __future__ import annotations

from kvlab.claims.commands import attention_profile
from kvlab.claims.evidence import AttentionProfile, Evidence, model_name
from kvlab.claims.verdicts import CONDITIONAL, FAILS, HOLDS, Evaluation, about, judged, unmeasurable

CLAIMED_SHARE = 0.5
"""Article 004: "over 50% of attention weight often concentrates on the first few tokens"."""


def _no_profiles(evidence: Evidence) -> Evaluation | None:
    """The reason there is nothing to evaluate, or None when there are profiles."""
    profiles, problems = evidence.profiles
    if profiles:
        return None
    command = attention_profile()
    found = "; ".join(problems) if problems else f"no attention profile in {evidence.results_place('attention')}"
    return unmeasurable(f"{found}; run: {command}", command=command)


def _provenance(profiles: list[AttentionProfile]) -> dict[str, str]:
    return {
        "model": ", ".join(model_name(profile.model) for profile in profiles),
        "device": ", ".join(sorted({profile.device for profile in profiles})),
        "command": "; ".join(profile.command for profile in profiles),
    }


def first_token_share(evidence: Evidence) -> Evaluation:
    """Claim 29: over 50% of the attention often goes to the first few tokens (here: the first token alone, a
    lower bound of the first few)."""
    none = _no_profiles(evidence)
    if none is not None:
        return none
    profiles, _ = evidence.profiles
    facts, often, some = [], [], []
    for profile in profiles:
        over = [layer.layer for layer in profile.layers if layer.first_token_share > CLAIMED_SHARE]
        strongest = max(profile.layers, key=lambda layer: layer.first_token_share)
        facts.append(
            f"{model_name(profile.model)}: above 50% in {len(over)} of {len(profile.layers)} layers (largest "
            f"{strongest.first_token_share:.0%}, layer {strongest.layer})"
        )
        if 2 * len(over) >= len(profile.layers):
            often.append(f"on {model_name(profile.model)}")
        elif over:
            some.append(f"in layers {', '.join(str(i) for i in over)} of {model_name(profile.model)}")
    figure = "attention share of the first token, mean over heads and queries: " + "; ".join(facts)
    if len(often) == len(profiles):
        return Evaluation(HOLDS, figure=figure, **_provenance(profiles))
    if often or some:
        return Evaluation(CONDITIONAL, figure=figure, condition="; ".join(often + some), **_provenance(profiles))
    return Evaluation(FAILS, figure=figure, **_provenance(profiles))


def entropy_falls_with_depth(evidence: Evidence) -> Evaluation:
    """Claim 11: early layers have high attention entropy, deep layers low (the first third's mean entropy more
    than 10% above the last third's)."""
    none = _no_profiles(evidence)
    if none is not None:
        return none
    profiles, _ = evidence.profiles
    parts, facts = [], []
    for profile in profiles:
        layers = sorted(profile.layers, key=lambda layer: layer.layer)
        third = max(1, len(layers) // 3)
        early = sum(layer.entropy for layer in layers[:third]) / third
        deep = sum(layer.entropy for layer in layers[-third:]) / third
        parts.append((f"on {model_name(profile.model)}", early > deep and not about(early, deep)))
        facts.append(
            f"{model_name(profile.model)}: {early:.2f} nats in layers {layers[0].layer}-{layers[third - 1].layer}, "
            f"{deep:.2f} in layers {layers[-third].layer}-{layers[-1].layer}"
        )
    return judged(parts, "mean attention entropy per layer: " + "; ".join(facts), **_provenance(profiles))
