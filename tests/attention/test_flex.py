"""The ``flex`` attention backend: the block mask of the heap's occupied slot blocks, one query's attention and the
scores H2O accumulates from the kernel's log-sum-exp, the same tokens as kvlab's own kernels in static steps, and the
backend each device gets. On a CPU flex_attention runs PyTorch's reference implementation: the mask and the
observation are checked here, the fused kernel's speed on a GPU by ``bench/heap_gpu.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_models import prompt, runs_in, small_policy, tiny_model

from kvlab.attention import flex, function, observe
from kvlab.attention.backends import ATTENTION_BACKENDS, check_attention, resolve_attention, stored_attention
from kvlab.attention.context import ForwardContext
from kvlab.attention.flex import BLOCK, PIPELINED_DECODE, block_mask, block_tables, decode_kernel, flex_decode_attention
from kvlab.attention.kernels import decode_attention
from kvlab.budget import Budget
from kvlab.cache.layer import AttentionShape, HeapLayer
from kvlab.cache.spec import CacheSpec
from kvlab.engine.generation import generate
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError
from kvlab.models.loading import wrap_model
from kvlab.policies import evicting


def visibility(batch: int, kv_heads: int, slots: int, seed: int) -> torch.Tensor:
    """Slots visible to a query: random, with one block left empty and one wholly visible."""
    generator = torch.Generator().manual_seed(seed)
    visible = torch.rand(batch, kv_heads, slots, generator=generator) > 0.6
    visible[..., BLOCK : 2 * BLOCK] = False
    visible[..., 2 * BLOCK : 3 * BLOCK] = True
    return visible


def test_ordering_partial_and_full_blocks_in_one_call_lists_each_kind_first_in_block_order():
    generator = torch.Generator().manual_seed(3)
    partial, full = (torch.rand(2, 1, 3, 9, generator=generator) > 0.5 for _ in range(2))
    partial_count, partial_indices, full_count, full_indices = flex.ordered_kinds(torch.stack((partial, full)))
    for chosen, count, indices in ((partial, partial_count, partial_indices), (full, full_count, full_indices)):
        assert torch.equal(count, chosen.sum(dim=-1, dtype=torch.int32))
        for row, listed, n in zip(chosen.flatten(0, 2), indices.flatten(0, 2), count.flatten(), strict=True):
            assert listed[:n].tolist() == row.nonzero().flatten().tolist()
            assert sorted(listed.tolist()) == list(range(9))


def test_the_block_mask_reads_the_occupied_blocks_and_masks_the_rest_slot_by_slot():
    slots, groups = 5 * BLOCK + 37, 3
    visible = visibility(2, 2, slots, seed=1)
    visible[1, :, 3 * BLOCK :] = False  # one sequence with nothing past its third block in either head
    visible[0, 1, 4 * BLOCK : 5 * BLOCK] = True  # a block wholly visible in one head only
    positions = torch.arange(slots, dtype=torch.int32).expand(2, 2, slots).masked_fill(~visible, -1)
    tables = block_tables(positions, torch.tensor([slots]), None)
    mask = block_mask(tables, slots, groups)
    assert mask.kv_indices.shape[:3] == (2, 1, 1)  # one list for every head: what the decoding kernel takes
    for b, (partial, full) in enumerate([([0, 3, 4, 5], [2]), ([0], [2])]):
        assert mask.kv_indices[b, 0, 0, : int(mask.kv_num_blocks[b, 0, 0])].tolist() == partial
        assert mask.full_kv_indices[b, 0, 0, : int(mask.full_kv_num_blocks[b, 0, 0])].tolist() == full
        assert sorted(mask.kv_indices[b, 0, 0].tolist()) == list(range(6))  # then the others: a permutation
    for b in range(2):  # the empty block 1 is never read; a partial block is read slot by slot, per head
        for h in range(2 * groups):
            for k in range(0, slots, 17):
                seen = mask.mask_mod(torch.tensor(b), torch.tensor(h), torch.tensor(0), torch.tensor(k))
                assert bool(seen) == bool(visible[b, h // groups, k])


def test_a_sliding_window_and_the_future_are_not_visible():
    positions = torch.arange(3 * BLOCK, dtype=torch.int32).expand(1, 1, -1)
    padded, partial_count, _, full_count, full_indices = block_tables(positions, torch.tensor([2 * BLOCK + 9]), 100)
    assert padded[0, 0].nonzero().flatten().tolist() == list(range(2 * BLOCK + 9 - 99, 2 * BLOCK + 10))
    assert int(full_count.sum()) == 0 and int(partial_count.sum()) == 2


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_one_query_gives_the_output_and_the_accumulated_scores_of_kvlabs_kernel(softcap):
    batch, kv_heads, groups, slots, head_dim = 2, 2, 3, 3 * BLOCK + 5, 16
    generator = torch.Generator().manual_seed(2)
    query = torch.randn(batch, kv_heads * groups, 1, head_dim, generator=generator)
    keys, values = (torch.randn(batch, kv_heads, slots, head_dim, generator=generator) for _ in range(2))
    visible = visibility(batch, kv_heads, slots, seed=3)
    positions = torch.arange(slots).expand(batch, kv_heads, slots).masked_fill(~visible, -1).to(torch.int32)

    def layer() -> HeapLayer:
        found = HeapLayer(keys=keys, values=values, positions=positions, scores=torch.zeros(batch, kv_heads, slots))
        found.shape = AttentionShape(None, head_dim**-0.5, softcap)
        return found

    reference_layer, flex_layer = layer(), layer()
    context = ForwardContext(SimpleNamespace(static=True))  # a static step: all that decode_attention asks of the heap
    reference = decode_attention(query, reference_layer, (keys, values, positions), visible.unsqueeze(2), context, 0)
    output = flex_decode_attention(query, flex_layer, keys, values, positions, torch.tensor([slots]))
    torch.testing.assert_close(output, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex_layer.scores, reference_layer.scores, rtol=1e-5, atol=1e-6)
    assert float(flex_layer.scores.masked_select(~visible).abs().max()) == 0.0


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("architecture", ["llama", "gemma2"])
def test_static_steps_under_flex_give_the_tokens_and_kept_sets_of_kvlabs_kernels(architecture, monkeypatch):
    loaded = wrap_model(tiny_model(architecture))
    ids = prompt(batch=2, length=40, seed=5)
    calls: list[str] = []
    counted = function.flex_decode_attention
    monkeypatch.setattr(
        function, "flex_decode_attention", lambda *args, **kwargs: calls.append(policy) or counted(*args, **kwargs)
    )
    for policy in ["full", *evicting()]:
        for mode in runs_in(policy):
            for layout in ("bitmask", "threshold"):
                budget = Budget(tokens=14) if policy != "full" else None
                common = dict(mode=mode, chunk=7, max_new_tokens=8, stop_token_ids=(), static=True)
                cache = CacheSpec(layout)
                sdpa = generate(loaded, ids, RunSpec(small_policy(policy), budget, cache=cache, **common))
                flex = generate(
                    loaded, ids, RunSpec(small_policy(policy), budget, cache=cache, attention="flex", **common)
                )
                assert flex.tokens == sdpa.tokens, (policy, mode, layout)
                assert flex.kept_per_layer == sdpa.kept_per_layer, (policy, mode, layout)
    assert {"full", "streaming", "h2o", "tova", "snapkv"} <= set(calls)  # flex decoded them: no silent fallback


def test_tova_scores_a_static_step_by_what_the_flex_kernel_gave_each_slot(monkeypatch):
    loaded = wrap_model(tiny_model("llama"))
    ids = prompt(batch=2, length=40, seed=7)
    second_passes: list[int] = []  # the window's scorings over the keys (a pass of their own)
    counted = observe._summed
    monkeypatch.setattr(observe, "_summed", lambda *args, **kwargs: second_passes.append(1) or counted(*args, **kwargs))
    results = {}
    for backend in ("sdpa", "flex"):
        second_passes.clear()
        common = dict(mode="streaming", chunk=7, max_new_tokens=12, stop_token_ids=(), static=True, attention=backend)
        results[backend] = (
            generate(loaded, ids, RunSpec(small_policy("tova"), Budget(tokens=14), **common)),
            len(second_passes),
        )
    (sdpa, sdpa_passes), (flex, flex_passes) = results["sdpa"], results["flex"]
    assert flex.tokens == sdpa.tokens and flex.kept_per_layer == sdpa.kept_per_layer
    decode_evictions = 12 - 1
    assert sdpa_passes - flex_passes == decode_evictions  # every decoded token's eviction, all layers in one pass


@pytest.mark.parametrize(
    ("capability", "dtype", "head_dim", "expected"),
    [
        ((9, 0), torch.bfloat16, 128, PIPELINED_DECODE),
        ((10, 0), torch.float32, 128, PIPELINED_DECODE),
        ((9, 0), torch.float32, 256, None),  # flex keeps one stage there for lack of shared memory
        ((9, 0), torch.bfloat16, 256, PIPELINED_DECODE),
        ((8, 0), torch.bfloat16, 128, None),
        ((11, 0), torch.bfloat16, 128, None),
    ],
)
def test_the_decoding_kernel_is_pipelined_on_hopper_and_blackwell(monkeypatch, capability, dtype, head_dim, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    query = SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype, shape=(1, 32, 1, head_dim))
    assert decode_kernel(query) == expected  # type: ignore[arg-type]
    assert decode_kernel(torch.zeros(1, 32, 1, head_dim, dtype=dtype)) is None  # a CPU: PyTorch's reference


def test_flex_decode_attention_hands_its_kernel_options_to_flex_attention(monkeypatch):
    seen = []
    real = flex.flex_attention
    monkeypatch.setattr(flex, "decode_kernel", lambda query: {"num_stages": 3})
    monkeypatch.setattr(
        flex, "flex_attention", lambda *args, **kwargs: seen.append(kwargs["kernel_options"]) or real(*args, **kwargs)
    )
    slots = 2 * BLOCK
    keys, values = torch.randn(1, 2, slots, 8), torch.randn(1, 2, slots, 8)
    positions = torch.arange(slots, dtype=torch.int32).expand(1, 2, slots).clone()
    layer = HeapLayer(keys=keys, values=values, positions=positions)
    layer.shape = AttentionShape(None, 8**-0.5, None)
    query = torch.randn(1, 4, 1, 8)
    flex_decode_attention(query, layer, keys, values, positions, torch.tensor([slots]))
    flex_decode_attention(query, layer, keys, values, positions, torch.tensor([slots]), None, {"num_warps": 4})
    assert seen == [{"num_stages": 3}, {"num_warps": 4}]


def test_auto_is_flex_where_it_compiles_and_sdpa_elsewhere():
    assert resolve_attention("auto", "cuda", flex_compiles=True) == "flex"
    assert resolve_attention("auto", "cuda", flex_compiles=False) == "sdpa"
    assert resolve_attention("auto", "cpu", flex_compiles=True) == "sdpa"
    for named in ("flex", "sdpa"):
        assert resolve_attention(named, "cpu", flex_compiles=False) == named
    assert RunSpec(small_policy("full")).attention_on(torch.device("cpu")) == "sdpa"
    assert RunSpec(small_policy("full"), attention="flex").attention_on(torch.device("cpu")) == "flex"
    # a run that decodes eagerly has no static steps: no backend of theirs in its identity
    assert RunSpec(small_policy("full"), attention="flex", static=False).attention_on(torch.device("cpu")) == "sdpa"


def test_a_backend_is_named_once_and_sdpa_keeps_every_older_runs_identity():
    assert [check_attention(name) for name in ATTENTION_BACKENDS] == list(ATTENTION_BACKENDS)
    with pytest.raises(KvlabError, match="Unknown attention backend 'triton'; use one of auto, flex, sdpa."):
        check_attention("triton")
    with pytest.raises(KvlabError, match="Unknown attention backend"):
        RunSpec(small_policy("full"), attention="cudnn")  # type: ignore[arg-type]
    assert stored_attention("sdpa") is None and stored_attention("flex") == "flex"
