"""The ``flex`` backend's chunked prefill: a chunk's attention over refilled slots, its block tables, and H2O's column
sums from the swapped pass's log-sum-exp. On a CPU flex_attention runs PyTorch's reference implementation: the masks
and the sums are checked here, the fused kernels' speed on a GPU by ``bench/heap_gpu.py --part prefill``."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from tiny_models import prompt, tiny_model
from torch.nn.attention.flex_attention import flex_attention

from kvlab.attention import function
from kvlab.attention.context import ForwardContext
from kvlab.attention.flex import BLOCK
from kvlab.attention.flex_chunks import chunk_mask, chunk_tables, flex_chunk_attention, swapped_mask
from kvlab.attention.kernels import blocked_attention
from kvlab.attention.masks import allowed_keys
from kvlab.budget import Budget
from kvlab.cache.layer import FREE, AttentionShape, HeapLayer
from kvlab.engine.generation import generate
from kvlab.engine.spec import RunSpec
from kvlab.models.loading import wrap_model
from kvlab.policies import make_policy


def refilled(batch: int, kv_heads: int, slots: int, queries: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot positions of a heap evicted and refilled: earlier tokens in any order, some slots free, the chunk's own
    ``queries`` tokens in scattered slots; and the chunk's positions."""
    generator = torch.Generator().manual_seed(seed)
    first = 1000
    chunk = torch.arange(first, first + queries)
    rows = []
    for _ in range(batch * kv_heads):
        earlier = torch.randperm(first, generator=generator)[: slots - queries]
        row = torch.cat([earlier, chunk])[torch.randperm(slots, generator=generator)]
        free = (torch.rand(slots, generator=generator) < 0.2) & (row < first)
        rows.append(row.masked_fill(free, FREE))
    return torch.stack(rows).view(batch, kv_heads, slots).to(torch.int32), chunk


@pytest.mark.parametrize(
    ("window", "softcap", "queries"), [(None, None, 200), (150, None, 130), (None, 30.0, 7), (None, None, 2 * BLOCK)]
)
def test_a_chunk_gives_the_output_and_the_column_sums_of_exact_attention(window, softcap, queries):
    batch, kv_heads, groups, slots, head_dim = 2, 2, 3, 3 * BLOCK + 40, 16
    generator = torch.Generator().manual_seed(4)
    keys, values = (torch.randn(batch, kv_heads, slots, head_dim, generator=generator) for _ in range(2))
    query = torch.randn(batch, kv_heads * groups, queries, head_dim, generator=generator)
    positions, chunk = refilled(batch, kv_heads, slots, queries, seed=5)

    def layer() -> HeapLayer:
        found = HeapLayer(
            keys=keys, values=values, positions=positions, scores=torch.zeros(batch, kv_heads, slots), used=slots
        )
        found.shape = AttentionShape(window, head_dim**-0.5, softcap)
        return found

    exact, flex = layer(), layer()
    mask = allowed_keys(positions, chunk, window)
    context = ForwardContext(SimpleNamespace(static=False))  # all that blocked_attention asks of the heap
    reference = blocked_attention(query, exact, 0, (keys, values, positions), mask, context, False)
    output = flex_chunk_attention(query, flex, chunk)
    torch.testing.assert_close(output, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex.scores, exact.scores, rtol=1e-5, atol=1e-6)
    assert float(flex.scores.masked_select(~mask.any(dim=2)).abs().max()) == 0.0  # what no query sees got nothing
    torch.testing.assert_close(flex.scores.sum(), torch.tensor(float(batch * kv_heads * groups * queries)))


def test_full_blocks_hide_nothing_and_skipped_blocks_show_nothing():
    slots, queries = 4 * BLOCK + 9, 2 * BLOCK + 3
    for window in (None, 100):
        positions, chunk = refilled(2, 2, slots, queries, seed=6)
        positions[0, :, :BLOCK] = torch.arange(BLOCK, dtype=torch.int32)  # a block every query sees whole
        positions[1, :, BLOCK : 2 * BLOCK] = FREE  # a block nobody sees
        _, _, full, some = chunk_tables(positions, chunk, window)
        seen = torch.zeros(2, 2, full.shape[2] * BLOCK, full.shape[3] * BLOCK, dtype=torch.bool)
        seen[..., :queries, :slots] = allowed_keys(positions, chunk, window)
        by_block = seen.view(2, 2, full.shape[2], BLOCK, full.shape[3], BLOCK)
        every, anything = by_block.all(dim=(3, 5)).all(dim=1), by_block.any(dim=(3, 5)).any(dim=1)
        assert not bool((full.squeeze(1) & ~every).any())  # a full block is visible everywhere
        assert not bool((anything & ~(full | some).squeeze(1)).any())  # a skipped block has nothing visible
        assert not bool((full & some).any())
        assert bool(full[0, 0, 0, 0]) == (window is None)  # the block of positions 0-127, seen whole without a window


def test_streaming_chunks_under_flex_keep_sdpas_tokens_and_kept_sets(monkeypatch):
    loaded = wrap_model(tiny_model("llama"))
    ids = prompt(batch=2, length=40, seed=8)
    chunks: list[str] = []
    counted = function.flex_chunk_attention
    monkeypatch.setattr(function, "flex_chunk_attention", lambda *args: chunks.append(mode) or counted(*args))
    for name in ("streaming", "h2o"):
        for mode in ("streaming", "prefill"):
            common = dict(mode=mode, chunk=7, max_new_tokens=6, stop_token_ids=())
            sdpa = generate(loaded, ids, RunSpec(make_policy(name), Budget(tokens=14), **common))
            flex = generate(loaded, ids, RunSpec(make_policy(name), Budget(tokens=14), attention="flex", **common))
            assert flex.tokens == sdpa.tokens, (name, mode)
            assert flex.kept_per_layer == sdpa.kept_per_layer, (name, mode)
    assert set(chunks) == {"streaming"}  # prefill mode's growing heap stays with SDPA


@pytest.mark.long
def test_sliding_window_masks_compile_into_flex_attentions_kernel():
    """The chunk's mask and the swapped pass's, lowered by Inductor into flex_attention's kernel (here for the CPU,
    as on CUDA for a GPU), give the reference implementation's output: a ``mask_mod`` that fails to lower (an
    in-place operation did, for every sliding-window model) fails here too. The CPU's kernel returns no log-sum-exp,
    so each mask is compiled into a plain attention over its own shape."""
    heads, groups, slots, head_dim, queries, window = 1, 4, 2 * BLOCK + 8, 16, 40, 100
    positions, chunk = refilled(1, heads, slots, queries, seed=8)
    tables = chunk_tables(positions, chunk, window)
    masks = {
        "chunk": (chunk_mask(tables, (queries, slots), groups, window), heads * groups, queries, slots),
        "swapped": (swapped_mask(tables, slots, groups, window), heads, slots, groups * tables[1].shape[0]),
    }
    generator = torch.Generator().manual_seed(7)
    compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    for name, (mask, query_heads, rows, columns) in masks.items():
        query = torch.randn(1, query_heads, rows, head_dim, generator=generator)
        keys, values = (torch.randn(1, heads, columns, head_dim, generator=generator) for _ in range(2))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention.*without torch.compile.*")
            reference = flex_attention(query, keys, values, block_mask=mask, enable_gqa=query_heads > heads)
        output = compiled(query, keys, values, block_mask=mask, enable_gqa=query_heads > heads)
        torch.testing.assert_close(output, reference, rtol=1e-4, atol=1e-4, msg=name)
