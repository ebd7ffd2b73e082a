"""Every claim of the catalogue evaluated against one store, and the store's claims table refreshed from it.

The command line (``kvlab claims``) and the dashboard's Claims page both call :func:`refresh`, so the two never
disagree about a verdict.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from kvlab.claims.catalogue import BY_ID, CATALOGUE, Claim
from kvlab.claims.commands import claims_command
from kvlab.claims.evidence import Evidence
from kvlab.errors import KvlabError
from kvlab.store import ClaimRecord, Store, has_database, open_store
from kvlab.store.rows import utcnow


def record(claim: Claim, evidence: Evidence) -> ClaimRecord:
    """One claim evaluated, as the row the claims table keeps."""
    result = claim.evaluate(evidence)
    return ClaimRecord(
        claim_id=claim.claim_id,
        article=claim.article_label,
        claim=claim.text,
        figure=result.figure,
        verdict=result.verdict_text,
        reason=result.reason,
        model=result.model,
        device=result.device,
        command=result.command or claims_command(claim.claim_id),
        refreshed_at=utcnow(),
    )


def evaluate_all(evidence: Evidence) -> list[ClaimRecord]:
    """Every claim of the catalogue, in its order."""
    return [record(claim, evidence) for claim in CATALOGUE]


def refresh(store: Store, results: Path | None = None) -> list[ClaimRecord]:
    """Evaluate every claim against ``store`` (and the benchmark results under ``results``, by default
    :func:`kvlab.paths.bench_results`) and make its claims table exactly that evaluation."""
    records = evaluate_all(Evidence(store, store.path, results))
    store.replace_claims(records)
    return records


def evaluate_file(path: Path, results: Path | None = None) -> list[ClaimRecord]:
    """Every claim evaluated against the store at ``path`` without writing anything (no file yet: no runs)."""
    store = open_store(path, read_only=True) if has_database(path) else None
    return evaluate_all(Evidence(store, path, results))


def check_ids(ids: Iterable[str]) -> list[str]:
    """The claim ids asked for, each once; an id not in the catalogue is one sentence."""
    wanted = list(dict.fromkeys(ids))
    unknown = [claim_id for claim_id in wanted if claim_id not in BY_ID]
    if unknown:
        raise KvlabError(
            f"There is no claim {', '.join(unknown)}; the claims are numbered {CATALOGUE[0].claim_id} to "
            f"{CATALOGUE[-1].claim_id}."
        )
    return wanted


def select(records: Iterable[ClaimRecord], ids: Iterable[str]) -> list[ClaimRecord]:
    """The records of the claims ``ids`` (all of them when there are none)."""
    wanted = check_ids(ids)
    return [row for row in records if not wanted or row.claim_id in wanted]
