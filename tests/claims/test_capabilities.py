"""The reasons claims cannot be measured, computed from what kvlab has: no reason denies a capability the
registries hold, and changing a registry changes the reasons."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvlab.attention.backends import ATTENTION_BACKENDS
from kvlab.cache.layouts import LAYOUTS
from kvlab.cache.spec import CacheOptions
from kvlab.claims import BY_ID, CATALOGUE, EVIDENCE_DB, Evidence, capabilities, evaluate_all, evaluate_file
from kvlab.claims.capabilities import Capability, Requirements, _source_policies, inventory, named
from kvlab.claims.verdicts import FAILS, HOLDS, UNMEASURABLE
from kvlab.models.catalog import ModelEntry
from kvlab.policies import POLICIES
from kvlab.policies.full import Full

REPO = Path(__file__).resolve().parents[2]
#: Words a reason might use for a capability instead of its registry name.
SYNONYMS = {"offload": "disk_tier_mib", "demot": "cpu_tier_mib", "sparse-attention": "rocketkv"}
#: A negation or need, then within three words a capability's word: the reason says kvlab lacks it. "no runs of"
#: says a measurement is missing, not a capability.
DENIAL = r"\b(?:no(?! runs)|not|without|lacks?|needs?)\s+(?:\S+\s+){{0,3}}?{word}"


def denied(reason: str, words: set[str]) -> list[str]:
    """The capability words a reason says kvlab lacks."""
    return [word for word in sorted(words) if re.search(DENIAL.format(word=re.escape(word)), reason, re.IGNORECASE)]


def capability_words() -> set[str]:
    """Every name the registries hold, and the words a reason might use for them instead."""
    names = {*POLICIES, *CacheOptions.names(), *LAYOUTS, *ATTENTION_BACKENDS}
    return names | {word for word, name in SYNONYMS.items() if name in names}


def test_the_checker_catches_the_stale_reasons_it_replaced():
    words = capability_words()
    assert denied("kvlab keeps its cache in device memory and has no offloading", words) == ["offload"]
    assert denied("needs RocketKV's models, benchmarks and sparse-attention kernels", words) == ["rocketkv"]
    assert denied("no runs of H2O on needle in x.duckdb; run: kvlab sweep", words) == []


@pytest.mark.parametrize("store", ["none", "shipped"])
def test_no_reason_denies_a_capability_kvlab_has(store, tmp_path):
    """Every claim's reason, on an empty store and on the shipped evidence, names as missing only what is."""
    rows = evaluate_all(Evidence(None, tmp_path / "none.duckdb", tmp_path / "no-results"))
    if store == "shipped":
        if not EVIDENCE_DB.is_file():
            pytest.skip("no shipped evidence store")
        rows = evaluate_file(EVIDENCE_DB)
    words = capability_words()
    for row in rows:
        assert not denied(row.reason or "", words), (row.claim_id, row.reason)


def test_a_reason_lists_exactly_the_needs_kvlab_lacks(tmp_path):
    evidence = Evidence(None, tmp_path / "none.duckdb", tmp_path / "no-results")
    have = inventory(evidence)
    for claim in CATALOGUE:
        if claim.requirements is None:
            continue
        lacking = claim.requirements.lacking(have)
        result = claim.evaluate(evidence)
        if lacking:
            assert result.verdict == UNMEASURABLE and f"needs {named(lacking)}" in str(result.reason), claim.claim_id
        met = [need for need in claim.requirements.needs if need not in lacking]
        if met and result.verdict == UNMEASURABLE and (lacking or claim.requirements.pending is None):
            assert f"kvlab has {named(met)}" in str(result.reason), claim.claim_id


def test_removing_a_policy_from_the_registry_changes_the_reason(monkeypatch, tmp_path):
    evidence = Evidence(None, tmp_path / "none.duckdb", tmp_path / "no-results")
    assert "kvlab has the policy rocketkv" in str(BY_ID["32"].evaluate(evidence).reason)
    monkeypatch.delitem(POLICIES, "rocketkv")
    reason = str(BY_ID["32"].evaluate(evidence).reason)
    assert "needs the policy rocketkv and the model Llama-3.1-8B" in reason and "kvlab has" not in reason


def test_adding_a_policy_to_the_registry_changes_the_reason(monkeypatch, tmp_path):
    evidence = Evidence(None, tmp_path / "none.duckdb", tmp_path / "no-results")
    needs = Requirements(needs=(Capability.policy("indirection"), Capability.option("hot")))
    assert needs.evaluate(evidence).reason == "needs the policy indirection; kvlab has the cache option hot"
    monkeypatch.setitem(POLICIES, "indirection", Full)
    assert needs.evaluate(evidence).reason == "kvlab has the policy indirection and the cache option hot"


def test_an_installed_model_leaves_the_needs(monkeypatch, tmp_path):
    evidence = Evidence(None, tmp_path / "none.duckdb", tmp_path / "no-results")
    entry = ModelEntry("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct", "hub cache", "", None)
    monkeypatch.setattr(capabilities, "available_models", lambda: [entry])
    reason = str(BY_ID["32"].evaluate(evidence).reason)
    assert "needs" not in reason and "kvlab has the policy rocketkv and the model Llama-3.1-8B" in reason


def test_the_registry_read_from_source_is_the_live_one():
    built_in = {name for name, cls in POLICIES.items() if cls.__module__.startswith("kvlab.policies.")}
    assert _source_policies() == built_in


def demotion(path: Path, deleted_ms: float, disk_ms: float) -> None:
    path.mkdir(parents=True, exist_ok=True)
    configurations = {
        "snapkv, evicted tokens deleted": {"params": {}, "decode_ms_per_token": deleted_ms},
        "cpu tier, promote": {"params": {"cpu_tier_mib": 64.0}, "decode_ms_per_token": disk_ms / 2},
        "disk tier, promote": {"params": {"disk_tier_mib": 64.0}, "decode_ms_per_token": disk_ms},
    }
    data = {"model": "m", "device": "NVIDIA H100", "context_tokens": 1024, "configurations": configurations}
    (path / "run.json").write_text(json.dumps(data))


def test_the_disk_penalty_is_measured_once_kvlab_has_a_disk_tier(monkeypatch, tmp_path):
    evidence = Evidence(None, tmp_path / "none.duckdb", tmp_path / "results")
    absent = BY_ID["37"].evaluate(evidence)
    assert absent.verdict == UNMEASURABLE and "no runs of a disk tier" in str(absent.reason)
    assert str(absent.reason).endswith(f"; run: {absent.command}")
    demotion(tmp_path / "results" / "demotion", 40.0, 80.0)
    measured = BY_ID["37"].evaluate(Evidence(None, tmp_path / "none.duckdb", tmp_path / "results"))
    assert measured.verdict == FAILS and "80.0 against 40.0 ms/token (2.00x)" in str(measured.figure)
    demotion(tmp_path / "slow" / "demotion", 1.0, 95.0)
    assert BY_ID["37"].evaluate(Evidence(None, tmp_path / "none.duckdb", tmp_path / "slow")).verdict == HOLDS
    monkeypatch.setattr(CacheOptions, "names", classmethod(lambda cls: ("hot",)))
    reason = BY_ID["37"].evaluate(Evidence(None, tmp_path / "none.duckdb", tmp_path / "slow")).reason
    assert reason == "needs the cache option disk_tier_mib"


def test_the_committed_demotion_timings_read(tmp_path):
    timed, problems = Evidence(None, tmp_path / "none.duckdb", REPO / "bench" / "results").demotions
    assert timed and not problems
