"""The cache spec: one description of how a run's cache stores what its policy keeps, importable without torch.

A policy scores tokens; how the cache holds the ones it keeps is the cache's business, described here once and
built into the heap's layers (:mod:`kvlab.cache.build`):

* the **layout** of the heap's slots (:mod:`kvlab.cache.layouts`: what becomes of evicted slots);
* the **layer allocation** (how the total budget, budget x layers, is spread over layers: :mod:`kvlab.cache.allocation`)
  and the **scope** that decides it on a model split over devices (:mod:`kvlab.cache.scopes`);
* the **head allocation** (Ada-KV: a layer's KV heads share its budget) and the **precision tiers** (the ``hot`` share
  of the kept tokens at 16 bits, the rest at ``key_bits``/``value_bits``), both of which move the kept tokens into
  frozen layers at prefill mode's compression (:mod:`kvlab.cache.tiers`);
* the **demotion tiers**: evicted tokens demoted to pinned CPU memory and an offload file and recalled by page
  instead of deleted (:mod:`kvlab.cache.demotion`);
* the **noise floor** added to the scores before ranking (:mod:`kvlab.cache.noise`).

The seventeen options other than the layout are set on the command line as parameters of any scoring policy
(``--param hot=0.25``, ``h2o[hot=0.25]`` in a sweep) and stored with the policy's parameters where they differ from
their defaults (:meth:`CacheOptions.stored`), so a run that uses none of them is the run it was before they existed.
Everything here is plain data and checks; the dashboard draws its widgets from the same declarations.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kvlab.cache.allocation import cake_budgets, entropy_budgets, preset_budgets
from kvlab.cache.layouts import DEFAULT_COMPACT_AT, DEFAULT_LAYOUT, LAYOUTS, HeapLayout
from kvlab.errors import KvlabError
from kvlab.modes import PREFILL
from kvlab.params import check_values, defaults, names, param
from kvlab.units import MIB

LAYER_ALLOCATIONS: tuple[str, ...] = ("uniform", "preset", "entropy", "cake")
HEAD_ALLOCATIONS: tuple[str, ...] = ("uniform", "adakv")
#: Who decides the layer budgets of a model split over devices (:mod:`kvlab.cache.scopes`).
SCOPES: tuple[str, ...] = ("local", "global")
#: The bit widths a key or value can be held at; 16 means "not quantised" (:mod:`kvlab.cache.quant`).
BITS: tuple[int, ...] = (2, 4, 8, 16)
#: The bit widths as the options list them, widest first.
WIDTHS: tuple[int, ...] = tuple(reversed(BITS))
#: The noise added to the scores before ranking (:mod:`kvlab.cache.noise`).
NOISE_KINDS: tuple[str, ...] = ("none", "gaussian", "laplace")
#: How a demoted page is summarised on the GPU for the recall's choice (:mod:`kvlab.cache.demotion`).
SUMMARIES: tuple[str, ...] = ("minmax", "mean")
#: Ada-KV's safeguard, the default ``head_floor``: each head first keeps this share of the per-head budget, its best
#: tokens, before the heads compete (kvpress's ``AdaKVPress.alpha_safeguard`` default), so no head is left with nothing.
ADAKV_SAFEGUARD = 0.2


#: The largest demotion tier a spec may ask for (1 PiB): beyond any machine, far below a float's overflow. A tier
#: larger than the machine's memory or free disk is refused when the run starts (``kvlab.cache.demotion``).
MOST_TIER_MIB = float(1 << 30)


@dataclass(frozen=True)
class TierSpec:
    """What the cold tier holds: bits per key and per value element, and the quantisation group (tokens per key
    group, channels per value group)."""

    key_bits: int = 16
    value_bits: int = 16
    group: int = 32


@dataclass(frozen=True)
class DemotionSpec:
    """The demotion tiers' byte budgets (over all layers; each layer gets an equal share) and the recall's rule."""

    cpu_bytes: int
    disk_bytes: int
    page_tokens: int = 16
    recall_pages: int = 8
    summary: str = "minmax"
    promote: bool = True
    prefetch: bool = False


@dataclass(frozen=True)
class CacheOptions:
    """The cache options any scoring policy takes as parameters (see the module's description)."""

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
    head_floor: float = param(
        ADAKV_SAFEGUARD,
        minimum=0.0,
        maximum=1.0,
        help="adakv: share of the per-head budget each KV head keeps before the heads compete (else unused)",
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
        0.0,
        minimum=0.0,
        maximum=MOST_TIER_MIB,
        help="MiB of pinned CPU memory that evicted tokens are demoted to instead of deleted",
    )
    disk_tier_mib: float = param(
        0.0,
        minimum=0.0,
        maximum=MOST_TIER_MIB,
        help="MiB of an offload file that demoted tokens move to once CPU memory is full",
    )
    page_tokens: int = param(16, minimum=1, maximum=4096, help="demoted tokens per page, per sequence and KV head")
    recall_pages: int = param(
        8, minimum=1, maximum=1 << 20, help="demoted pages a forward pass recalls per layer and KV head"
    )
    page_summary: str = param("minmax", choices=SUMMARIES, help="what the GPU keeps of a demoted page to choose it")
    promote: bool = param(True, help="recalled pages stay on the GPU while the queries keep choosing them")
    prefetch: bool = param(False, help="fetch the next pass's pages while the current one computes (speculative)")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The options, in declaration order (the order a variant's name lists them in)."""
        return names(cls)

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every option with its default."""
        return defaults(cls)

    @classmethod
    def from_stored(cls, stored: dict[str, Any]) -> CacheOptions:
        """The options of a stored run's parameters (the policy's own ones ignored, missing options at their
        defaults)."""
        return cls(**{name: stored[name] for name in cls.names() if name in stored})

    def stored(self) -> dict[str, Any]:
        """The options that differ from their defaults, as a run stores them beside its policy's parameters."""
        base = self.defaults()
        return {name: getattr(self, name) for name in self.names() if getattr(self, name) != base[name]}

    @property
    def tiered(self) -> bool:
        """Whether some kept tokens leave the 16-bit heap (a cold tier, quantised or not)."""
        return self.hot < 1.0

    @property
    def freezes(self) -> bool:
        """Whether prefill mode's compression moves the kept tokens into frozen layers (precision tiers or
        head-adaptive budgets) instead of evicting in place."""
        return self.tiered or self.pools_heads

    @property
    def demotes(self) -> bool:
        """Whether evicted tokens are demoted instead of deleted (a CPU or disk tier)."""
        return self.cpu_tier_mib > 0.0 or self.disk_tier_mib > 0.0

    @property
    def global_scope(self) -> bool:
        """Whether one threshold over every layer's scores decides the layer budgets."""
        return self.scope == "global"

    @property
    def measures_layers(self) -> str | None:
        """What the layer allocation follows that only the run can measure: ``profile`` (the model's stored
        attention entropy), ``prompt`` (CAKE's preferences from the prompt's own attention, at the compression), or
        ``None``."""
        return {"entropy": "profile", "cake": "prompt"}.get(self.layer_allocation)

    @property
    def capturable(self) -> bool:
        """Whether an eviction with these options can be captured in a CUDA graph: noise draws from a generator a
        graph would not advance, and demotion moves pages from the host."""
        return self.noise == "none" and not self.demotes

    @property
    def noisy(self) -> bool:
        """Whether noise is added to the scores before ranking."""
        return self.noise != "none" and self.noise_scale != 0.0

    def tier(self) -> TierSpec:
        """What the cold tier holds."""
        return TierSpec(self.key_bits, self.value_bits, self.quant_group)

    def head_safeguard(self) -> float | None:
        """Ada-KV's per-head floor as a share of the budget, or ``None`` for uniform heads."""
        return self.head_floor if self.pools_heads else None

    @property
    def pools_heads(self) -> bool:
        """Whether a layer's KV heads share its budget (Ada-KV), so that a global threshold is one over the heads
        too."""
        return self.head_allocation == "adakv"

    def demotion(self) -> DemotionSpec | None:
        """Where evicted tokens are demoted and how they are recalled, or ``None`` where they are deleted."""
        if not self.demotes:
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

    def layer_budgets(
        self,
        budget: int,
        num_layers: int,
        minimum: int,
        capacity: int | None = None,
        measured: list[float] | tuple[float, ...] | None = None,
    ) -> list[int]:
        """The layer allocation's budgets (:mod:`kvlab.cache.allocation`), at the same total as uniform ones. Before
        CAKE's preferences are measured (the heap is planned before the prompt is read) they are uniform."""
        if self.layer_allocation == "uniform" or (self.layer_allocation == "cake" and measured is None):
            return [budget] * num_layers
        if self.layer_allocation == "preset":
            return preset_budgets(budget, num_layers, minimum, capacity)
        if measured is None:
            raise ValueError("the entropy allocation follows a measured profile")
        if self.layer_allocation == "entropy":
            return entropy_budgets(measured, budget, num_layers, minimum, capacity)
        return cake_budgets(measured, budget, minimum, capacity)

    def check(self, policy: str, *, own_layer_budgets: bool = False, equal_layer_budgets: bool = False) -> None:
        """Refuse, in one sentence naming ``policy``, a value out of bounds or options that cannot go together, or
        that the policy cannot take: one that spreads its budget over layers itself (``own_layer_budgets``:
        PyramidKV) takes no other allocation, and one that needs the same budget in every layer
        (``equal_layer_budgets``: ChunkKV reusing a layer's choice) neither."""
        check_values(self, f"policy {policy!r}")
        if self.hot == 1.0 and (self.key_bits, self.value_bits) != (16, 16):
            raise KvlabError(
                f"Policy {policy!r} holds every kept token at 16 bits while hot is 1; set hot below 1 to hold "
                "the rest at the key and value bits."
            )
        if self.demotes and self.freezes:
            raise KvlabError(
                f"Policy {policy!r} cannot demote evicted tokens and also hold its kept ones in frozen layers "
                "(precision tiers or adakv); choose one."
            )
        if own_layer_budgets and self.layer_allocation != "uniform":
            raise KvlabError(
                f"Policy {policy!r} spreads its budget over layers itself; use layer_allocation with another "
                "policy (snapkv scores as pyramidkv does)."
            )
        if self.global_scope and (self.layer_allocation != "uniform" or own_layer_budgets):
            raise KvlabError(
                f"Policy {policy!r} with scope='global' lets one threshold over every layer's scores decide the "
                "layer budgets, so it takes layer_allocation='uniform' and no budgets of its own."
            )
        if equal_layer_budgets and (self.layer_allocation != "uniform" or self.global_scope):
            raise KvlabError(
                f"Policy {policy!r} reuses a layer's kept positions in the next layers, which needs the same "
                "budget in every layer; use layer_allocation='uniform', scope='local' or reuse_layers=1."
            )

    def check_mode(self, policy: str, mode: str) -> None:
        """Refuse, in one sentence, a mode these options cannot run in: what is set once at prefill mode's
        compression needs prefill mode."""
        if mode == PREFILL:
            return
        uses = [
            what
            for what, used in (
                ("precision tiers (hot below 1)", self.tiered),
                ("head-adaptive budgets (adakv)", self.pools_heads),
                ("CAKE's layer allocation", self.layer_allocation == "cake"),
                ("the global eviction scope", self.global_scope),
            )
            if used
        ]
        if uses:
            raise KvlabError(
                f"Policy {policy!r} uses {' and '.join(uses)}, set once at prefill mode's compression; "
                "run it in prefill mode."
            )


@dataclass(frozen=True)
class CacheSpec:
    """A run's whole cache: the heap's ``layout`` (and the threshold layout's ``compact_at``) and its
    :class:`CacheOptions`."""

    layout: str = param(DEFAULT_LAYOUT, choices=LAYOUTS, help="what becomes of evicted slots")
    compact_at: float = param(
        DEFAULT_COMPACT_AT, minimum=0.0, maximum=1.0, open_minimum=True, help="the threshold layout's dead share"
    )
    options: CacheOptions = field(default_factory=CacheOptions)

    def __post_init__(self) -> None:
        self.heap_layout()

    def heap_layout(self) -> HeapLayout:
        """The heap's layout (checked: an unknown layout or threshold is one sentence)."""
        return HeapLayout(self.layout, self.compact_at)  # type: ignore[arg-type]

    def with_options(self, options: CacheOptions) -> CacheSpec:
        """This spec with other options."""
        return replace(self, options=options)

    def stored_layout(self) -> tuple[str, float | None]:
        """The layout as a run stores it: its name, and its threshold where it has one."""
        return self.layout, self.compact_at if self.layout == "threshold" else None
