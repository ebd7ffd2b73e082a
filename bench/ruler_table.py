"""The RULER scores of a store's runs as Markdown tables: one per model, context length and setting (question read
before or after compression), a row per policy and a column per kept fraction, each score with its 95% interval
(:func:`kvlab.tasks.ruler_score.ruler_scores`), and the device the runs were measured on.

Usage:
    python bench/ruler_table.py --db kvlab/data/runs/ruler.duckdb > bench/results/ruler/table.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pandas as pd  # noqa: E402

from kvlab.runs.tables import policy_name  # noqa: E402
from kvlab.store import open_store  # noqa: E402
from kvlab.tasks.ruler_score import ruler_scores  # noqa: E402


def tables(runs: pd.DataFrame, trials: pd.DataFrame) -> str:
    """Markdown tables of the RULER runs in ``runs`` (``Store.list_runs``) from their ``trials``."""
    scores = ruler_scores(trials)
    runs = runs[runs["run_id"].isin(list(scores))].copy()
    runs["label"] = [policy_name(p, params) for p, params in zip(runs["policy"], runs["policy_params"])]
    runs["cell"] = [
        f"{100 * scores[r].score.value:.1f} [{100 * scores[r].score.low:.1f}, {100 * scores[r].score.high:.1f}]"
        for r in runs["run_id"]
    ]
    runs["compression"] = ["none" if pd.isna(k) else f"{100 * (1 - k):.0f}%" for k in runs["keep"]]
    out = []
    for (model, context, aware), group in runs.groupby(["model", "context_length", "query_aware"], sort=True):
        items = {scores[r].score.items for r in group["run_id"]}
        setting = "question read before compression" if aware else "question read after compression"
        out.append(
            f"### {model}, {context:,} tokens, {setting}\n\n"
            f"RULER score in % [95% interval], {', '.join(map(str, sorted(items)))} items per run "
            f"(11 tasks); {', '.join(sorted(group['device'].dropna().unique()))}.\n"
        )
        columns = sorted(group["compression"].unique(), key=lambda c: (c != "none", c))
        table = group.pivot_table(index="label", columns="compression", values="cell", aggfunc="first")
        table = table.reindex(columns=columns).reindex(list(dict.fromkeys(group["label"]))).fillna("")
        out.append(table.to_markdown() + "\n")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", default="kvlab/data/runs/ruler.duckdb")
    args = parser.parse_args()
    with open_store(args.db, read_only=True) as store:
        print(tables(store.list_runs(), store.trials_frame()))


if __name__ == "__main__":
    main()
