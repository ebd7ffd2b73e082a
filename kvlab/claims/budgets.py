"""Claim 12, measured: the articles' preset layer budgets (40% of the budget to the first layers, 10% to the last)
"cut memory by another 15%".

Moving budget between layers at the same total saves nothing by itself (:func:`~kvlab.claims.computed.preset_shares`);
the saving the article means is a smaller total that keeps the accuracy. So the preset runs at 85% of the uniform
budgets' kept fractions, and each uniform cell is compared with the preset cell whose measured KV bytes are closest to
85% of its own: the preset saves the 15% where it is then no less accurate, on the needle task at 4,096 tokens.
"""

from __future__ import annotations

import pandas as pd

from kvlab.claims.commands import (
    ALLOCATION_BASE,
    ALLOCATION_KEEPS,
    PRESET_KEEPS,
    PRESET_SAVING,
    heap_sweep,
    with_options,
)
from kvlab.claims.computed import preset_shares
from kvlab.claims.evidence import Evidence
from kvlab.claims.needle import CELL_COLUMNS, full_cache_cell, needle_cells
from kvlab.claims.needle_claims import NEEDLE_TASK, NEGLIGIBLE_LOSS, cell_text, model_of, needle_group
from kvlab.claims.units import percent
from kvlab.claims.verdicts import Evaluation, about, judged, missing
from kvlab.modes import PREFILL

PRESET = with_options(ALLOCATION_BASE, "layer_allocation=preset")


def _closest(candidates: pd.DataFrame, reference: pd.Series) -> pd.Series | None:
    """The candidate cell whose KV bytes come closest to ``1 - PRESET_SAVING`` of the reference's, among those
    about that far below it, or None."""
    ratios = candidates["kv_bytes"] / reference["kv_bytes"]
    near = ratios[[about(ratio, 1 - PRESET_SAVING) for ratio in ratios]]
    return candidates.loc[(near - (1 - PRESET_SAVING)).abs().idxmin()] if not near.empty else None


def preset_saves_memory(evidence: Evidence) -> Evaluation:
    """Claim 12: the preset keeps the uniform budget's accuracy with 15% fewer KV bytes."""
    group = needle_group(evidence)
    model = model_of(group)
    command = "; ".join(
        (
            heap_sweep(evidence.db, ["full", ALLOCATION_BASE, PRESET], ALLOCATION_KEEPS, model=model),
            heap_sweep(evidence.db, [PRESET], PRESET_KEEPS, model=model),
        )
    )
    cells = needle_cells(group.trials) if group is not None else pd.DataFrame(columns=CELL_COLUMNS)
    cells = cells[(cells["mode"] == PREFILL) & cells["kv_bytes"].notna()]
    uniform, preset = cells[cells["variant"] == ALLOCATION_BASE], cells[cells["variant"] == PRESET]
    parts, facts = [], []
    for _, reference in uniform.sort_values("pruning", ascending=False).iterrows():
        match = _closest(preset, reference) if not preset.empty else None
        if match is None:
            continue
        kept = percent(1 - reference["pruning"])
        parts.append((f"at {kept} kept", reference["accuracy"] - match["accuracy"] <= NEGLIGIBLE_LOSS))
        share = percent(match["kv_bytes"] / reference["kv_bytes"])
        facts.append(
            f"{kept} kept: uniform {cell_text(reference)}, preset with {share} of its KV bytes (keeping "
            f"{percent(1 - match['pruning'], 1)}) {cell_text(match)}"
        )
    if group is None or not parts:
        return missing(
            f"{ALLOCATION_BASE} with uniform and preset layer budgets {percent(PRESET_SAVING)} apart on {NEEDLE_TASK}",
            evidence.db,
            command,
            figure=preset_shares(),
        )
    full = full_cache_cell(group.trials)
    ceiling = f"; full cache {cell_text(full)}" if full is not None else ""
    figure = (
        f"{ALLOCATION_BASE} on {NEEDLE_TASK}, the preset at 85% of the uniform budget's measured KV bytes: "
        + "; ".join(facts)
        + ceiling
        + f" (saves {percent(PRESET_SAVING)}: the preset at most {NEGLIGIBLE_LOSS:.0f} points less accurate). "
        + f"Formula: {preset_shares()}"
    )
    return judged(parts, figure, model=group.model, device=group.device, command=command)
