"""Claims measured on caches held at lower precision (claims 16, 27 and 35): needle accuracy and KV bytes at 4,096
tokens against the full cache's, and, where the store has them, the perplexity of a held-out text read under the
same cache (``kvlab quality`` passes) against the full cache's on the same tokens.

A configuration is a policy with cache options of its own (:func:`~kvlab.claims.options.variant`), in prefill mode,
where precision tiers are set at the one compression. Its bytes are the mean KV bytes its trials held at the end,
measured from the cache's tensors (packed codes, scales and zero points included) with the question and the answer,
exactly as the full cache's are; the formula's readings of the claim stand beside them.
"""

from __future__ import annotations

import pandas as pd

from kvlab.claims.commands import (
    BIT_WIDTHS,
    HYBRID,
    HYBRID_KEEP,
    PRECISION_BASES,
    QUANTISED,
    QUANTISED_KEEP,
    bits_variant,
    heap_quality,
    heap_sweep,
    quality_budget,
    with_options,
)
from kvlab.claims.computed import hybrid_readings, quantised_readings
from kvlab.claims.evidence import Evidence, Group
from kvlab.claims.needle import full_cache, full_cache_cell, needle_cells, with_variants
from kvlab.claims.needle_claims import NEEDLE_TASK, NEGLIGIBLE_LOSS, cell_text, model_of, needle_group
from kvlab.claims.sinks import perplexity
from kvlab.claims.units import percent
from kvlab.claims.verdicts import ABOUT, Evaluation, about, judged, missing
from kvlab.modes import PREFILL
from kvlab.units import MIB

CLAIMED_SAVING = 0.92
"""Claim 16: "total KV memory -92%"."""
HYBRID_LOSS = 1.0
"""Claim 16: "LongBench within 1%", read as at most one point of needle accuracy and 1% of perplexity."""
CLAIMED_RATIO = 40.0
"""Claim 35: "cuts memory 40x"."""
QUANTISED_LOSS = 2.0
"""Claim 35: "under 2% accuracy loss", in points of needle accuracy."""


class Measured:
    """What a precision claim compares, read once: the needle cells of the model with the most needle trials with
    its full-cache cell, and the quality passes over held-out texts."""

    def __init__(self, evidence: Evidence) -> None:
        self.group: Group | None = needle_group(evidence)
        self.cells = needle_cells(self.group.trials) if self.group is not None else pd.DataFrame()
        self.full = full_cache_cell(self.group.trials) if self.group is not None else None
        rows = evidence.quality_trials
        if not rows.empty:
            rows = with_variants(rows[rows["nll"].notna() & (rows["scored_tokens"].fillna(0) > 0)])
        self.passes = rows

    @property
    def model(self) -> str | None:
        return model_of(self.group)

    def cell(self, name: str, keep: float) -> pd.Series | None:
        """The prefill-mode needle cell of the variant ``name`` keeping ``keep``, or None."""
        if self.cells.empty or self.full is None:
            return None
        rows = self.cells[
            (self.cells["variant"] == name)
            & (self.cells["mode"] == PREFILL)
            & ((self.cells["pruning"] - round(1 - keep, 4)).abs() < 1e-9)
        ]
        return rows.iloc[0] if not rows.empty else None

    def perplexity_ratio(self, name: str, keep: float) -> float | None:
        """The perplexity of the variant ``name``'s prefill-mode pass keeping ``keep`` of the prefix, against the
        full cache's on the same tokens (same text, same prefix), or None."""
        if self.passes.empty:
            return None
        rows = self.passes[
            (self.passes["variant"] == name)
            & (self.passes["mode"] == PREFILL)
            & (self.passes["budget_tokens"] == quality_budget(keep))
        ]
        if rows.empty:
            return None
        same = self.passes[
            (self.passes["task"] == rows["task"].iloc[0]) & (self.passes["item_hash"] == rows["item_hash"].iloc[0])
        ]
        full = same[full_cache(same)]
        ours = rows[rows["item_hash"] == rows["item_hash"].iloc[0]]
        return perplexity(ours) / perplexity(full) if not full.empty else None

    def provenance(self) -> dict[str, str | None]:
        assert self.group is not None
        return {"model": self.group.model, "device": self.group.device}


def _full_text(measured: Measured) -> str:
    """The full cache's needle cell, the reference of every comparison."""
    assert measured.full is not None
    return f"full cache {cell_text(measured.full)}"


def _survives(cell: pd.Series | None, ratio: float | None, full: pd.Series) -> bool | None:
    """Whether a configuration is as good as the full cache: needle accuracy at most
    :data:`~kvlab.claims.needle_claims.NEGLIGIBLE_LOSS` points below it and perplexity within :data:`ABOUT` of it
    (whichever was measured); None when neither was."""
    checks = []
    if cell is not None:
        checks.append(full["accuracy"] - cell["accuracy"] <= NEGLIGIBLE_LOSS)
    if ratio is not None:
        checks.append(ratio <= 1 + ABOUT)
    return all(checks) if checks else None


def bits_label(key_bits: int, value_bits: int) -> str:
    return f"K{key_bits}/V{value_bits}"


def keys_and_values_bits(evidence: Evidence) -> Evaluation:
    """Claim 27: keys need 4 bits; values survive 2 bits. Every token is kept and quantised (nothing evicted), keys
    and values at the bit widths of :data:`~kvlab.claims.commands.BIT_WIDTHS`."""
    measured = Measured(evidence)
    names = ["full", *(bits_variant(key, value) for key, value in BIT_WIDTHS)]
    command = "; ".join(
        (
            heap_sweep(evidence.db, names, (1.0,), model=measured.model),
            heap_quality(evidence.db, [(PREFILL, quality_budget(1.0), names)], model=measured.model),
        )
    )
    readings: dict[tuple[int, int], tuple[pd.Series | None, float | None]] = {}
    for key, value in BIT_WIDTHS:
        cell = measured.cell(bits_variant(key, value), 1.0)
        ratio = measured.perplexity_ratio(bits_variant(key, value), 1.0)
        if cell is not None or ratio is not None:
            readings[(key, value)] = (cell, ratio)
    if measured.full is None or not readings:
        return missing(
            f"keys and values quantised to 8, 4 and 2 bits beside the full cache on {NEEDLE_TASK}", evidence.db, command
        )
    full = measured.full

    def survives(key: int, value: int) -> bool | None:
        return _survives(*readings[(key, value)], full) if (key, value) in readings else None

    checks = (
        ("keys at 4 bits suffice", survives(4, 16)),
        ("keys at 2 bits fall short", None if survives(2, 16) is None else not survives(2, 16)),
        ("values at 2 bits suffice", survives(16, 2)),
    )
    parts = [(label, bool(held)) for label, held in checks if held is not None]
    facts = []
    for (key, value), (cell, ratio) in readings.items():
        shown = [f"needle {cell_text(cell)}"] if cell is not None else []
        shown += [f"perplexity x{ratio:.3f} the full cache's"] if ratio is not None else []
        facts.append(f"{bits_label(key, value)}: {', '.join(shown)}")
    figure = (
        "every token kept and quantised (KIVI's groups: keys per channel, values per token): "
        + "; ".join(facts)
        + f"; {_full_text(measured)} (as good as the full cache: at most {NEGLIGIBLE_LOSS:.0f} points below its "
        f"accuracy and within {ABOUT:.0%} of its perplexity; keys need 4 bits when 4 suffice and 2 do not)"
    )
    if not parts:
        return missing(f"K4/V16, K2/V16 or K16/V2 on {NEEDLE_TASK}", evidence.db, command, figure)
    return judged(parts, figure, command=command, **measured.provenance())


def _bytes_text(cell: pd.Series, full: pd.Series) -> str:
    return f"{cell['kv_bytes'] / MIB:,.2f} MiB against {full['kv_bytes'] / MIB:,.2f} MiB"


def hybrid_precision(evidence: Evidence) -> Evaluation:
    """Claim 16: FP16 for the top 5% of tokens, 4 bits for the rest of the kept 20%: KV memory -92%, quality within
    1% (here: needle accuracy and perplexity; kvlab has no LongBench)."""
    measured = Measured(evidence)
    hybrids = [with_options(base, HYBRID) for base in PRECISION_BASES]
    command = "; ".join(
        (
            heap_sweep(evidence.db, ["full", *PRECISION_BASES, *hybrids], (HYBRID_KEEP,), model=measured.model),
            heap_quality(
                evidence.db,
                [(PREFILL, None, ["full"]), (PREFILL, quality_budget(HYBRID_KEEP), hybrids[:1])],
                model=measured.model,
            ),
        )
    )
    formula = "formula: " + "; ".join(
        f"{percent(1 - remaining, 1)} saved {label}" for label, remaining in hybrid_readings().items()
    )
    parts, facts = [], []
    full = measured.full
    for base, name in zip(PRECISION_BASES, hybrids):
        cell = measured.cell(name, HYBRID_KEEP)
        if cell is None or full is None:
            continue
        remaining = cell["kv_bytes"] / full["kv_bytes"]
        parts.append((f"in memory with {base}", about(remaining, 1 - CLAIMED_SAVING)))
        parts.append((f"in needle accuracy with {base}", full["accuracy"] - cell["accuracy"] <= HYBRID_LOSS))
        saved = percent(1 - remaining, 1)
        fact = f"{name}: {saved} of the KV bytes saved ({_bytes_text(cell, full)}), needle {cell_text(cell)}"
        sixteen = measured.cell(base, HYBRID_KEEP)
        if sixteen is not None:
            fact += f" (the same eviction in 16 bits: {cell_text(sixteen)})"
        ratio = measured.perplexity_ratio(name, HYBRID_KEEP)
        if ratio is not None:
            parts.append((f"in perplexity with {base}", ratio <= 1 + HYBRID_LOSS / 100))
            fact += f", perplexity x{ratio:.3f}"
        facts.append(fact)
    if not parts:
        return missing(
            f"the hybrid cache ({HYBRID}, keep {HYBRID_KEEP:g}) beside the full cache on {NEEDLE_TASK}",
            evidence.db,
            command,
            formula,
        )
    figure = (
        f"{'; '.join(facts)}; {_full_text(measured)} (holds: memory within {ABOUT:.0%} of the claimed 8% left, at "
        f"most {HYBRID_LOSS:.0f} point of accuracy and 1% of perplexity lost). {formula}"
    )
    return judged(parts, figure, command=command, **measured.provenance())


def quantised_and_evicted(evidence: Evidence) -> Evaluation:
    """Claim 35: 4-bit KV quantisation plus 90% eviction cuts memory 40x with under 2% accuracy loss."""
    measured = Measured(evidence)
    variants = [with_options(base, QUANTISED) for base in PRECISION_BASES]
    command = heap_sweep(evidence.db, ["full", *PRECISION_BASES, *variants], (QUANTISED_KEEP,), model=measured.model)
    formula = "formula: " + "; ".join(f"{ratio:.1f}x {label}" for label, ratio in quantised_readings().items())
    parts, facts = [], []
    full = measured.full
    for base, name in zip(PRECISION_BASES, variants):
        cell = measured.cell(name, QUANTISED_KEEP)
        if cell is None or full is None:
            continue
        ratio = full["kv_bytes"] / cell["kv_bytes"]
        parts.append((f"in memory with {base}", about(ratio, CLAIMED_RATIO)))
        parts.append((f"in accuracy with {base}", full["accuracy"] - cell["accuracy"] < QUANTISED_LOSS))
        fact = f"{name}: {ratio:.1f}x less KV ({_bytes_text(cell, full)}), needle {cell_text(cell)}"
        sixteen = measured.cell(base, QUANTISED_KEEP)
        if sixteen is not None:
            fact += f" (the same eviction in 16 bits: {cell_text(sixteen)})"
        facts.append(fact)
    if not parts:
        return missing(
            f"4-bit caches keeping {QUANTISED_KEEP:g} beside the full cache on {NEEDLE_TASK}",
            evidence.db,
            command,
            formula,
        )
    figure = (
        f"{'; '.join(facts)}; {_full_text(measured)} (holds: within {ABOUT:.0%} of 40x, less than "
        f"{QUANTISED_LOSS:.0f} points of accuracy lost). {formula}"
    )
    return judged(parts, figure, command=command, **measured.provenance())
