"""The slots' order by position kept from step to step in static decoding (:mod:`kvlab.cache.order`): brought up to
date without a sort, it is the sorted order after any run of frees and appends, compactions included; static steps
of every policy sort no slots; and the runs that keep it decode and keep exactly what eager decoding does."""

from __future__ import annotations

import pytest
import torch
from test_heap import run, spec
from tiny_models import prompt, tiny_model

import kvlab.cache.layer
from kvlab.cache.layer import FREE
from kvlab.cache.layouts import LAYOUTS
from kvlab.cache.order import SlotOrder, caught_up, position_order
from kvlab.engine.static import StaticSteps
from kvlab.models.loading import wrap_model
from kvlab.policies import POLICIES


def held_in_order(order: SlotOrder, positions: torch.Tensor) -> None:
    """Assert that ``order`` lists the held slots by position, then the free ones (each slot once)."""
    assert torch.equal(order.slots.sort(dim=-1).values, torch.arange(positions.shape[-1]).expand_as(order.slots))
    held = positions.gather(-1, order.slots)
    expected = positions.gather(-1, position_order(positions))
    assert torch.equal(held, expected)


@pytest.mark.parametrize("appends_between", [1, 3])
def test_catching_up_after_frees_and_appends_gives_the_sorted_order(appends_between: int) -> None:
    generator = torch.Generator().manual_seed(0)
    rows, capacity, held_count = (3, 2), 24, 15
    positions = torch.full((*rows, capacity), FREE, dtype=torch.int32)
    for row in range(rows[0]):
        for head in range(rows[1]):  # the first tokens in scattered slots, as after evictions
            slots = torch.randperm(capacity, generator=generator)[:held_count]
            positions[row, head, slots] = torch.arange(held_count, dtype=torch.int32)
    next_position = held_count
    order = SlotOrder.of(positions, next_position)
    for step in range(40):
        for _ in range(appends_between):  # each appended token goes to a free slot of every row, at the same position
            free = (positions < 0).float()
            slot = torch.multinomial(free.flatten(0, 1), 1, generator=generator).view(*rows, 1)
            positions.scatter_(-1, slot, next_position)
            next_position += 1
        order.catch_up(positions, next_position)
        held_in_order(order, positions)
        if step % 7 == 6:  # a compaction: the held slots gathered to the front in position order
            positions = positions.gather(-1, position_order(positions))
            order.compacted()
            held_in_order(order, positions)
        held = (positions >= 0).float()
        victims = torch.multinomial(held.flatten(0, 1), appends_between, generator=generator)
        positions.scatter_(-1, victims.view(*rows, appends_between), FREE)


def test_the_catch_up_is_one_graph_for_the_compiler() -> None:
    """A static step on CUDA runs the catch-up compiled (:func:`kvlab.fusion.fused`, ``fullgraph=True``): traced here
    with no break, it gives the eager answer."""
    positions = torch.tensor([[[4, FREE, 1, 0, FREE, 2, 3, FREE]]], dtype=torch.int32)
    order = SlotOrder.of(positions, 5)
    positions[0, 0, 1] = 5  # one token appended since, and one older token freed
    positions[0, 0, 2] = FREE
    torch._dynamo.reset()
    compiled = torch.compile(caught_up, backend="eager", fullgraph=True, dynamic=False)
    assert torch.equal(compiled(order.slots, positions, order.mark), caught_up(order.slots, positions, order.mark))
    order.catch_up(positions, 6)
    held_in_order(order, positions)


PROMPT = prompt(batch=2, length=40, seed=5)


@pytest.fixture(scope="module")
def llama():
    return wrap_model(tiny_model("llama"))


def streaming_policies() -> list[str]:
    return [name for name, cls in POLICIES.items() if cls.evicts and not cls.reads_sparsely and name != "kvzip"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_static_steps_sort_no_slots_by_position(llama, layout: str, monkeypatch) -> None:
    """A policy that reads its slots in position order declares it, and its static steps read the kept order: a
    policy that sorted slots inside a static step without declaring it would fail here."""
    sorts_in_static_steps = []
    sort, step = position_order, StaticSteps.step

    def counted_sort(positions: torch.Tensor) -> torch.Tensor:
        sorts_in_static_steps.append(inside[0])
        return sort(positions)

    inside = [False]

    def counted_step(self, ids, index):
        inside[0] = True
        try:
            return step(self, ids, index)
        finally:
            inside[0] = False

    monkeypatch.setattr(kvlab.cache.layer, "position_order", counted_sort)
    monkeypatch.setattr(StaticSteps, "step", counted_step)
    for policy in streaming_policies():
        sorts_in_static_steps.clear()
        _, _, generation = run(llama, spec(policy, "streaming", layout, 14, static=True), PROMPT)
        assert not any(sorts_in_static_steps), (policy, layout)
        keeps = generation.cache.layers[0].order is not None
        assert keeps == POLICIES[policy].reads_position_order, (policy, layout)


@pytest.mark.parametrize("policy", ["snapkv", "chunkkv"])
def test_kept_order_decodes_like_eager_with_tokens_appended_between_evictions(llama, policy: str) -> None:
    eager = run(llama, spec(policy, "streaming", "bitmask", 14, static=False, compression_interval=3), PROMPT)
    static = run(llama, spec(policy, "streaming", "bitmask", 14, static=True, compression_interval=3), PROMPT)
    assert static[0] == eager[0] and static[1] == eager[1]
    assert static[2].cache.layers[0].order is not None
