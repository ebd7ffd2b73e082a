"""The pure parts of ``bench/kvpress_parity.py``: kept positions found from keys, one head's comparison and its
category, the summaries and the table. kvpress itself is not needed."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import bench_script


@pytest.fixture(scope="module")
def parity():
    with bench_script("kvpress_parity") as module:
        yield module


def test_kept_positions_are_found_from_gathered_keys(parity):
    full = torch.randn(2, 3, 12, 4)
    chosen = torch.stack([torch.randperm(12)[:5] for _ in range(6)]).view(2, 3, 5)
    kept = full.gather(2, chosen.unsqueeze(-1).expand(-1, -1, -1, 4))
    assert torch.equal(parity.kept_positions(full, kept), chosen.sort(dim=-1).values)


def test_kept_positions_refuse_ambiguous_or_foreign_keys(parity):
    full = torch.randn(1, 1, 6, 4)
    twins = full.clone()
    twins[0, 0, 3] = twins[0, 0, 1]
    with pytest.raises(ValueError, match="bitwise equal"):
        parity.kept_positions(twins, twins[:, :, :2])
    with pytest.raises(ValueError, match="matches no cached key"):
        parity.kept_positions(full, full[:, :, :2] + 1.0)


def test_chunk_scores_are_chunk_means_of_the_head_sums(parity):
    scores = torch.tensor([[[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 2.0]]])
    per_token = parity.chunk_scores_per_token(scores, 3)
    # head sums 2, 2, 4, 4, 6, 6, 9: chunks [0, 3) mean 8/3, [3, 6) mean 16/3, the partial [6, 7) 9
    expected = torch.tensor([[8 / 3] * 3 + [16 / 3] * 3 + [9.0]])
    assert torch.allclose(per_token, expected)


def compared(parity, kvlab_kept, kvpress_kept, kvlab_scores, kvpress_scores, rule=frozenset()):
    return parity.compare_head((0, 1, 2), kvlab_kept, kvpress_kept, kvlab_scores, kvpress_scores, rule)


def test_head_categories(parity):
    scores = [5.0, 1.0, 2.0, 2.0, 4.0]
    same = compared(parity, [0, 4], [4, 0], scores, scores)
    assert (same.category, same.jaccard, same.only_kvlab) == ("identical", 1.0, ())
    tie = compared(parity, [0, 2], [0, 3], scores, scores)
    assert (tie.category, tie.only_kvlab, tie.only_kvpress, tie.gap) == ("tie", (2,), (3,), 0.0)
    assert tie.jaccard == pytest.approx(1 / 3)
    # the tie may show on kvlab's side only (kvpress's scores of the two differ)
    assert compared(parity, [0, 2], [0, 3], scores, [5.0, 1.0, 2.0, 3.0, 4.0]).category == "tie"
    ruled = compared(parity, [0, 4], [0, 2], [5.0, 1.0, 2.0, 1.0, float("inf")], scores)
    assert ruled.category == "rule"
    assert compared(parity, [0, 1], [0, 4], [5.0, 3.0, 2.0, 1.0, 2.5], scores, frozenset({4})).category == "rule"
    assert compared(parity, [0, 4], [0], scores, scores).category == "size"
    near = [5.0, 1.0, 2.0, 2.0 * (1 + 1e-7), 4.0]
    assert compared(parity, [0, 2], [0, 3], [5.0, 1.0, 3.0, 2.0, 4.0], near).category == "rounding"
    other = compared(parity, [0, 1], [0, 4], [5.0, 3.0, 2.0, 1.0, 2.5], scores)
    assert (other.category, other.kvpress_scores, other.kvlab_scores) == ("other", (1.0, 4.0), (3.0, 2.5))


def test_relative_gap(parity):
    assert parity.relative_gap([2.0, 2.0]) == 0.0
    assert parity.relative_gap([1.0, 4.0]) == pytest.approx(0.75)
    assert parity.relative_gap([1.0, float("inf")]) == float("inf")


def test_summary_and_table(parity):
    scores = [5.0, 1.0, 2.0, 2.0, 4.0]
    heads = [
        compared(parity, [0, 4], [0, 4], scores, scores),
        compared(parity, [0, 2], [0, 3], scores, scores),
        compared(parity, [0, 1], [0, 4], [5.0, 3.0, 2.0, 1.0, 2.5], scores),
    ]
    summary = parity.summarise(heads)
    assert summary["heads"] == 3
    assert summary["jaccard_mean"] == pytest.approx((1 + 1 / 3 + 1 / 3) / 3)
    assert summary["jaccard_min"] == pytest.approx(1 / 3)
    assert summary["categories"] == {"identical": 1, "size": 0, "tie": 1, "rule": 0, "rounding": 0, "other": 1}
    assert summary["max_gap_rounding_or_other"] == pytest.approx(0.75)
    assert summary["examples"]["other"][0]["only_kvpress"] == [4]
    result = {
        "model": "m",
        "pairs": [{"policy": "knorm", "params": {}, "press": "KnormPress", "keeps": {"0.25": summary}}],
    }
    row = parity.markdown_table([result]).splitlines()[-1]
    assert row == "| m | `knorm`  | `KnormPress` | 0.25 | 3 | 33.3% | 0.5556 | 0.3333 | 0 / 1 / 0 / 0 / 1 |"


def test_kvpress_reads_the_cache_under_its_old_names(parity):
    cache, positions = object(), torch.arange(7).unsqueeze(0)
    renamed = parity.with_cache_as_past_key_values({"cache": cache, "position_ids": positions, "hidden_states": 1})
    assert renamed["past_key_values"] is cache and renamed["hidden_states"] == 1
    assert torch.equal(renamed["cache_position"], torch.arange(7))
