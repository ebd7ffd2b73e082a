"""Packed projections: a layer's query, key and value (and gate and up) projections computed as one matrix product in
fused forwards, with no memory added, the model's own parameters and eager forward unchanged, and the same logits."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHITECTURES, prompt, tiny_gemma3, tiny_model

from kvlab.models.compiled import decoder_layers
from kvlab.models.packed import PackPart, pack_layer, packable, packs_in_place

MODELS = {**{name: lambda name=name: tiny_model(name) for name in ARCHITECTURES}, "gemma3": tiny_gemma3}


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind the model's parameters."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


@pytest.mark.parametrize("architecture", sorted(MODELS))
def test_packed_projections_give_the_models_logits_with_no_memory_added(architecture):
    model = MODELS[architecture]()
    ids = prompt(batch=2, length=12, seed=4)
    before, state, size = logits(model, ids), {k: v.clone() for k, v in model.state_dict().items()}, held_bytes(model)
    swaps = sum((pack_layer(layer) for layer in decoder_layers(model)), ())
    # every layer's attention (query, key, value) and MLP (gate, up) packed
    assert [swap.name for swap in swaps] == ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"] * 3
    assert held_bytes(model) == size  # the projections' weights are views of the stacks, not copies beside them
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    torch.testing.assert_close(logits(model, ids), before, rtol=0, atol=0)  # eager: the model's own modules
    with packs_in_place(swaps):
        attention = model.get_decoder().layers[0].self_attn
        assert isinstance(attention.q_proj, PackPart)
        stack = attention.q_proj.pack.weight  # the weights' own storage, not stacked again
        assert stack is not None
        assert stack.untyped_storage().data_ptr() == swaps[0].own.weight.untyped_storage().data_ptr()
        torch.testing.assert_close(logits(model, ids), before, rtol=1e-5, atol=1e-5)
    assert type(model.get_decoder().layers[0].self_attn.q_proj) is torch.nn.Linear
    assert all(swap.part.pack.weight is None for swap in swaps)  # no stack held outside a fused forward


def test_weights_replaced_after_packing_are_stacked_again_before_a_fused_forward():
    model = tiny_model("qwen2")  # biases on its query, key and value
    swaps = sum((pack_layer(layer) for layer in decoder_layers(model)), ())
    ids = prompt(batch=1, length=10, seed=2)
    model.to(torch.float64)  # new tensors: the stacks are stale, and none is kept alive beside them
    assert all(swap.part.pack.weight is None and swap.part.pack.bias is None for swap in swaps)
    with torch.no_grad():
        model.get_decoder().layers[1].mlp.up_proj.weight.mul_(-1.0)  # and one changed in place afterwards
    expected = logits(model, ids)
    with packs_in_place(swaps):
        stack = swaps[0].part.pack.weight
        assert stack is not None and stack.dtype == torch.float64
        torch.testing.assert_close(logits(model, ids), expected, rtol=1e-10, atol=1e-10)
    with torch.no_grad():  # in place after stacking: the views see it, nothing to stack again
        model.get_decoder().layers[0].self_attn.k_proj.weight.mul_(0.5)
    expected = logits(model, ids)
    with packs_in_place(swaps):
        torch.testing.assert_close(logits(model, ids), expected, rtol=1e-10, atol=1e-10)


class KeyFirst(torch.nn.Module):
    """Projections called out of order: the first part called would not be the one that computes the product."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, hidden):
        key = self.k_proj(hidden)
        return self.q_proj(hidden) + key + self.v_proj(hidden)


class TwoInputs(torch.nn.Module):
    """Gate and up over different inputs: not one product."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, hidden):
        return self.gate_proj(hidden) * self.up_proj(hidden * 2)


class Mixed(TwoInputs):
    """One projection without a bias, or of another kind than ``nn.Linear``."""

    def forward(self, hidden):
        return self.gate_proj(hidden) * self.up_proj(hidden)


def test_projections_out_of_order_over_other_inputs_or_unlike_are_left_as_they_are():
    assert packable(KeyFirst(), ("q_proj", "k_proj", "v_proj")) is None
    assert packable(TwoInputs(), ("gate_proj", "up_proj")) is None
    mixed = Mixed()
    assert packable(mixed, ("gate_proj", "up_proj")) is not None
    mixed.up_proj = torch.nn.Linear(8, 8, bias=False)
    assert packable(mixed, ("gate_proj", "up_proj")) is None
    mixed.up_proj = torch.nn.Linear(8, 8).to(torch.float64)
    assert packable(mixed, ("gate_proj", "up_proj")) is None
    mixed.up_proj = torch.nn.Linear(8, 8)
    mixed.up_proj.forward = mixed.up_proj.forward  # a forward of its own, as accelerate's device hooks install
    assert packable(mixed, ("gate_proj", "up_proj")) is None
    mixed.up_proj = torch.nn.Linear(8, 8)
    mixed.up_proj.register_forward_pre_hook(lambda module, args: None)
    assert packable(mixed, ("gate_proj", "up_proj")) is None
    mixed.up_proj = torch.nn.Sequential(torch.nn.Linear(8, 8))  # type: ignore[assignment]
    assert packable(mixed, ("gate_proj", "up_proj")) is None
    assert pack_layer(KeyFirst()) == () and pack_layer(TwoInputs()) == ()
