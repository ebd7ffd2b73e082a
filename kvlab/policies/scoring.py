"""What every scoring policy can add to its ranking: how the budget is spread over layers and heads, precision tiers
for the tokens it keeps, and a noise floor.

These are parameters of every policy that ranks tokens by a score (all but the full cache and the first-token
ablation), declared once here, so that any policy takes any of them and they are checked, stored and drawn like its
own parameters. At their defaults (uniform budgets in the local scope, everything at 16 bits, no noise) they are left
out of a policy's stored parameters: a run that uses none of them is the same run it was before they existed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from kvlab.cache.allocation import cake_budgets, entropy_budgets, preset_budgets
from kvlab.cache.demotion import MIB, SUMMARIES, DemotionSpec
from kvlab.cache.noise import NOISE_KINDS, add_noise, unit_noise
from kvlab.cache.quant import BITS
from kvlab.cache.tiers import ADAKV_SAFEGUARD, TierSpec
from kvlab.errors import KvlabError
from kvlab.policies.base import KEEP, LayerView, Policy, param

LAYER_ALLOCATIONS: tuple[str, ...] = ("uniform", "preset", "entropy", "cake")
HEAD_ALLOCATIONS: tuple[str, ...] = ("uniform", "adakv")
#: Who decides the layer budgets of a model split over devices (:mod:`kvlab.cache.scopes`).
SCOPES: tuple[str, ...] = ("local", "global")
#: The bit widths a key or value can be held at, widest first.
WIDTHS: tuple[int, ...] = tuple(reversed(BITS))


@dataclass
class ScoringPolicy(Policy):
    """A policy that ranks the cached tokens by a score, with the cache options every such policy takes.

    ``layer_allocation`` spreads the total budget (budget x layers) over layers: evenly, by the articles' preset, by
    the model's measured attention entropy, or by CAKE's per-prompt layer preferences (:mod:`kvlab.cache.allocation`).
    ``scope`` says who decides it on a model whose layers a device map split into placement groups: each group over its
    own layers (``local``), or one threshold over every layer's scores at prefill mode's compression (``global``,
    :mod:`kvlab.cache.scopes`).
    ``head_allocation='adakv'`` lets the heads of a layer share its budget by one top-k over all of them (Ada-KV),
    each head then holding its own number of tokens. ``hot`` is the share of the kept tokens held at 16 bits; the
    rest are held at ``key_bits``/``value_bits`` (KIVI's grouping, ``quant_group`` tokens per key group and channels
    per value group). ``noise`` adds seeded noise of ``noise_scale`` times the spread of the scores before ranking.
    """

    #: Parameters of every scoring policy, separate from the policy's own (see :meth:`cache_option_names`).
    layer_allocation: str = param(
        "uniform", choices=LAYER_ALLOCATIONS, help="how the total budget is spread over layers"
    )
    scope: str = param(
        "local",
        choices=SCOPES,
        help="local: each device's layers share their own budgets; global: one threshold over all layers (prefill)",
    )
    head_allocation: str = param(
        "uniform", choices=HEAD_ALLOCATIONS, help="adakv: one top-k over the KV heads of a layer (prefill mode)"
    )
    hot: float = param(
        1.0, minimum=0.0, maximum=1.0, help="share of the kept tokens held at 16 bits; the rest at key/value bits"
    )
    key_bits: int = param(16, choices=WIDTHS, help="bits per key element outside the hot share")
    value_bits: int = param(16, choices=WIDTHS, help="bits per value element outside the hot share")
    quant_group: int = param(32, minimum=1, maximum=4096, help="tokens per key group, channels per value group")
    noise: str = param("none", choices=NOISE_KINDS, help="noise added to the scores before ranking")
    noise_scale: float = param(0.0, minimum=0.0, help="noise scale, relative to the spread of the scores")
    cpu_tier_mib: float = param(
        0.0, minimum=0.0, help="MiB of pinned CPU memory that evicted tokens are demoted to instead of deleted"
    )
    disk_tier_mib: float = param(
        0.0, minimum=0.0, help="MiB of an offload file that demoted tokens move to once CPU memory is full"
    )
    page_tokens: int = param(16, minimum=1, maximum=4096, help="demoted tokens per page, per sequence and KV head")
    recall_pages: int = param(
        8, minimum=1, maximum=1 << 20, help="demoted pages a forward pass recalls per layer and KV head"
    )
    page_summary: str = param("minmax", choices=SUMMARIES, help="what the GPU keeps of a demoted page to choose it")
    promote: bool = param(True, help="recalled pages stay on the GPU while the queries keep choosing them")
    prefetch: bool = param(False, help="fetch the next pass's pages while the current one computes (speculative)")

    #: Whether the policy spreads its budget over layers itself (PyramidKV), so takes no other layer allocation.
    own_layer_budgets: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hot == 1.0 and (self.key_bits, self.value_bits) != (16, 16):
            raise KvlabError(
                f"Policy {self.name!r} holds every kept token at 16 bits while hot is 1; set hot below 1 to hold "
                "the rest at the key and value bits."
            )
        if self.demotion() is not None and (self.tiered or self.head_allocation == "adakv"):
            raise KvlabError(
                f"Policy {self.name!r} cannot demote evicted tokens and also hold its kept ones in frozen layers "
                "(precision tiers or adakv); choose one."
            )
        if self.own_layer_budgets and self.layer_allocation != "uniform":
            raise KvlabError(
                f"Policy {self.name!r} spreads its budget over layers itself; use layer_allocation with another "
                "policy (snapkv scores as pyramidkv does)."
            )
        if self.scope == "global" and (self.layer_allocation != "uniform" or self.own_layer_budgets):
            raise KvlabError(
                f"Policy {self.name!r} with scope='global' lets one threshold over every layer's scores decide the "
                "layer budgets, so it takes layer_allocation='uniform' and no budgets of its own."
            )

    @classmethod
    def cache_option_names(cls) -> tuple[str, ...]:
        """The parameters every scoring policy takes, in declaration order."""
        return tuple(item.name for item in fields(ScoringPolicy))

    def params(self) -> dict[str, object]:
        """The policy's parameters, the cache options only where they differ from their defaults."""
        defaults = {item.name: item.default for item in fields(ScoringPolicy)}
        return {name: value for name, value in super().params().items() if defaults.get(name, object()) != value}

    def demotion(self) -> DemotionSpec | None:
        """Where evicted tokens are demoted and how they are recalled (:mod:`kvlab.cache.demotion`), or ``None`` where
        they are deleted (both tiers at 0 MiB)."""
        if self.cpu_tier_mib == 0.0 and self.disk_tier_mib == 0.0:
            return None
        return DemotionSpec(
            cpu_bytes=int(self.cpu_tier_mib * MIB),
            disk_bytes=int(self.disk_tier_mib * MIB),
            page_tokens=self.page_tokens,
            recall_pages=self.recall_pages,
            summary=self.page_summary,
            promote=self.promote,
            prefetch=self.prefetch,
        )

    @property
    def tiered(self) -> bool:
        """Whether some kept tokens leave the 16-bit heap (a cold tier, quantised or not)."""
        return self.hot < 1.0

    def layer_budgets(
        self, budget: int, num_layers: int, capacity: int | None = None, measured: Sequence[float] | None = None
    ) -> list[int]:
        """The layer allocation's budgets (:mod:`kvlab.cache.allocation`), at the same total as uniform ones. Before
        CAKE's preferences are measured (the heap is planned before the prompt is read) they are uniform."""
        if self.layer_allocation == "uniform" or (self.layer_allocation == "cake" and measured is None):
            return super().layer_budgets(budget, num_layers, capacity)
        if self.layer_allocation == "preset":
            return preset_budgets(budget, num_layers, self.min_budget(), capacity)
        assert measured is not None, "the entropy allocation follows a measured profile"
        if self.layer_allocation == "entropy":
            return entropy_budgets(measured, budget, num_layers, self.min_budget(), capacity)
        return cake_budgets(measured, budget, self.min_budget(), capacity)

    def measures_layers(self) -> str | None:
        return {"entropy": "profile", "cake": "prompt"}.get(self.layer_allocation)

    def freezes(self) -> bool:
        return self.tiered or self.head_allocation == "adakv"

    def check_mode(self, mode: str) -> None:
        if mode == "prefill":
            return
        uses = [
            what
            for what, used in (
                ("precision tiers (hot below 1)", self.tiered),
                ("head-adaptive budgets (adakv)", self.head_allocation == "adakv"),
                ("CAKE's layer allocation", self.layer_allocation == "cake"),
                ("the global eviction scope", self.scope == "global"),
            )
            if used
        ]
        if uses:
            raise KvlabError(
                f"Policy {self.name!r} uses {' and '.join(uses)}, set once at prefill mode's compression; "
                "run it in prefill mode."
            )

    def tier(self) -> TierSpec:
        """What the cold tier holds."""
        return TierSpec(self.key_bits, self.value_bits, self.quant_group)

    def head_safeguard(self) -> float | None:
        """Ada-KV's per-head floor as a share of the budget, or ``None`` for uniform heads."""
        return ADAKV_SAFEGUARD if self.head_allocation == "adakv" else None

    def can_capture(self) -> bool:
        """Noise draws from a generator that a CUDA graph would not advance; demotion moves pages from the host."""
        return super().can_capture() and self.noise == "none" and self.demotion() is None

    def perturb(self, view: LayerView, scores: torch.Tensor) -> torch.Tensor:
        """The scores with the noise floor added (unchanged without noise or at scale 0). One draw per held token
        in position order, as the random policy draws, so every layout adds the same noise to the same token; one
        draw per token for all KV heads where they share a ranking (TOVA). Free slots take no part in the spread."""
        if self.noise == "none" or self.noise_scale == 0.0:
            return scores

        def draw(ordered: torch.Tensor) -> torch.Tensor:
            batch, kv_heads, span = ordered.shape
            live = view.cache.live
            heads = 1 if self.heads_share_ranking() else kv_heads
            held = unit_noise(self.noise, torch.Size((batch, heads, live)), view.generator, ordered.device)
            held = held.expand(batch, kv_heads, live)
            return torch.cat([held, ordered.new_zeros((batch, kv_heads, span - live))], dim=-1)

        draws = view.in_position_order(view.positions.float(), draw)
        return add_noise(scores.masked_fill(view.positions < 0, KEEP), draws, self.noise_scale)
