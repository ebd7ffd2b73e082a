"""The quantitative claims of the articles kvlab grew from, each beside kvlab's own figure and a verdict.

A claim's figure is computed from published configs with :mod:`kvlab.costs`, measured from the runs of a kvlab
store (needle accuracy, perplexity and KL divergence, KV bytes of evicted, quantised and reallocated caches, decode
time, the slots evictions rank) or from the benchmark results a source checkout keeps (attention profiles,
short-context timings, attention entropy with the heavy hitters removed, the side-channel experiment;
:func:`kvlab.paths.bench_results`), or the claim cannot be measured here and says why.
Verdicts follow from the figures by one small rule per claim.
:func:`refresh` writes them to a store's claims table, for ``kvlab claims`` and the dashboard's Claims page.

Nothing here imports torch. The needle table of article 002 and kvlab's measurement beside it (used by the
Frontier page and ``bench/needle_claim.py``) live in :mod:`kvlab.claims.needle`.
"""

from kvlab.claims.catalogue import ARTICLES, BY_ID, CATALOGUE, Claim
from kvlab.claims.evaluate import check_ids, evaluate_all, evaluate_file, refresh, select
from kvlab.claims.evidence import EVIDENCE_DB, Evidence, default_claims_db
from kvlab.claims.needle import (
    CLAIM_CONTEXT,
    PRUNING,
    PUBLISHED_NEEDLE_CLAIM,
    measured_table,
    needle_cells,
    published_table,
    side_by_side,
)
from kvlab.claims.verdicts import VERDICTS, Evaluation, Verdict, verdict_of

__all__ = [
    "ARTICLES",
    "BY_ID",
    "CATALOGUE",
    "CLAIM_CONTEXT",
    "EVIDENCE_DB",
    "PRUNING",
    "PUBLISHED_NEEDLE_CLAIM",
    "VERDICTS",
    "Claim",
    "Evaluation",
    "Evidence",
    "Verdict",
    "check_ids",
    "default_claims_db",
    "evaluate_all",
    "evaluate_file",
    "measured_table",
    "needle_cells",
    "published_table",
    "refresh",
    "select",
    "side_by_side",
    "verdict_of",
]
