"""Evaluated claims as text: a table for a terminal, CSV, Markdown or JSON (``kvlab claims --format``)."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from collections.abc import Sequence
from typing import Literal, get_args

import pandas as pd

from kvlab.store import ClaimRecord

Format = Literal["table", "csv", "markdown", "json"]
FORMATS: tuple[Format, ...] = get_args(Format)
COLUMNS = [field.name for field in dataclasses.fields(ClaimRecord)]


def records_frame(records: Sequence[ClaimRecord]) -> pd.DataFrame:
    """The records as the claims table holds them (``Store.claims_frame()`` has the same columns)."""
    return pd.DataFrame([dataclasses.asdict(row) for row in records], columns=COLUMNS)


def shown_figure(figure: str | None, reason: str | None) -> str:
    """What a reader sees in kvlab's column: the figure, the reason there is none, or both."""
    return "; ".join(part for part in (figure, f"not measured: {reason}" if reason else None) if part)


def source_text(model: str | None, device: str | None) -> str:
    """Where a figure came from: ``Llama-3-70B · formula`` (``formula`` once when neither is a model)."""
    parts = list(dict.fromkeys(part for part in (model, device) if part))
    return " · ".join(parts) or "—"


def as_table(records: Sequence[ClaimRecord], width: int = 120) -> str:
    """One block per claim: its id, article and text, then kvlab's figure, the reason it has none (or only part of
    one), the verdict, where the figure came from and the command, each wrapped to ``width`` under its label."""
    blocks = []
    for row in records:
        head = textwrap.wrap(f"{row.claim_id:>3}  [{row.article}] {row.claim}", width, subsequent_indent=" " * 5)
        lines = [
            ("kvlab", row.figure),
            ("reason", row.reason),
            ("verdict", row.verdict),
            ("from", source_text(row.model, row.device) if row.figure else None),
            ("run", row.command),
        ]
        body = [
            wrapped
            for label, text in lines
            if text
            for wrapped in textwrap.wrap(
                text, width, initial_indent=f"     {label:<8} ", subsequent_indent=" " * 14, break_on_hyphens=False
            )
        ]
        blocks.append("\n".join(head + body))
    return "\n\n".join(blocks)


def _markdown_cell(value: object) -> str:
    """A table cell: pipes escaped, line breaks flattened, nothing shown as ``None``."""
    text = "" if value is None or (isinstance(value, float) and pd.isna(value)) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def as_markdown(records: Sequence[ClaimRecord]) -> str:
    """A Markdown table: claim, kvlab's figure (or why none), verdict, source and command."""
    header = ["#", "article", "claim", "kvlab", "verdict", "model · device", "command"]
    rows = [
        [
            row.claim_id,
            row.article,
            row.claim,
            shown_figure(row.figure, row.reason),
            row.verdict,
            source_text(row.model, row.device),
            f"`{row.command}`",
        ]
        for row in records
    ]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(_markdown_cell(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def render(records: Sequence[ClaimRecord], fmt: Format, width: int = 120) -> str:
    """The records in one of :data:`FORMATS`."""
    if fmt == "table":
        return as_table(records, width)
    if fmt == "markdown":
        return as_markdown(records)
    if fmt == "json":
        return json.dumps(
            [{**dataclasses.asdict(row), "refreshed_at": row.refreshed_at.isoformat()} for row in records], indent=2
        )
    return records_frame(records).to_csv(index=False).rstrip("\n")
