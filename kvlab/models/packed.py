"""A decoder layer's projections of one input (query, key and value; gate and up) as one matrix product in fused steps.

A decode step of one token multiplies one row by every weight matrix, each product a matrix-vector kernel and most of
them a split-K reduction after it; the small ones read their weights well under the copy bandwidth (Llama-3-8B's key
and value projections, 1,024 x 4,096 each, at 1.6 TB/s on an H200 against 3.8 for the gate's 14,336 x 4,096:
``bench/results/heap_gpu/profile_h2o_32k_h200.json``). Stacked into one matrix, as gpt-fast and vLLM store them, the
projections that read the same input become one product: three kernels and their reductions become one, over the
same bytes.

The weights are concatenated once per layer and the projections' own weights become views of the concatenation, so
nothing is added to memory and the model's parameters, state dict and eager forward stay as they were. Only inside a
fused step (:func:`kvlab.models.compiled.layer_stance`) is each projection replaced by a :class:`PackPart`: the first
that the forward calls computes the whole product and the others take their columns of it. That relies on the forward
calling the projections in order on one input, which is read from its source (``self.q_proj(hidden_states)``, then
``self.k_proj(hidden_states)``, then ``self.v_proj(hidden_states)``); a module whose source says otherwise, or whose
projections are not plain ``nn.Linear`` of one input size, dtype and device, is left as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
from collections.abc import Iterator

import torch
import torch.nn.functional as F

#: Projections of one input that a forward calls one after the other, by their attribute names, in that order.
PACKABLE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def stacked_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor that ``tensors`` (contiguous, of one dtype and device) are consecutive rows of, over their shared
    storage, or None where they are not (one of them was replaced since it was stacked)."""
    first = tensors[0]
    offset = first.storage_offset()
    for tensor in tensors:
        same_storage = tensor.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        if not (same_storage and tensor.is_contiguous() and tensor.storage_offset() == offset):
            return None
        if tensor.dtype != first.dtype or tensor.shape[1:] != first.shape[1:]:
            return None
        offset += tensor.numel()
    rows = sum(tensor.shape[0] for tensor in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


@dataclasses.dataclass(eq=False)
class Pack:
    """The projections ``linears``, their weights (and biases) consecutive rows of one stacked tensor each. The
    stacks are held here (``weight``, ``bias``) only while a fused forward may read them, so that a model moved or
    converted since (``model.to(...)``) keeps no stale copy alive; and the last product while a fused forward is
    between its first and last projection."""

    linears: tuple[torch.nn.Linear, ...]
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    output: torch.Tensor | None = None

    @classmethod
    def of(cls, linears: tuple[torch.nn.Linear, ...]) -> Pack:
        """The projections ``linears`` stacked, their weights (and biases) made views of the stacks."""
        pack = cls(linears)
        pack.restack()
        pack.release()
        return pack

    def restack(self) -> None:
        """Stack the projections' weights (and biases) again, make them views of the stacks, and hold the stacks."""
        with torch.no_grad():
            self.weight = torch.cat([linear.weight.data for linear in self.linears])
            biases = [linear.bias.data for linear in self.linears if linear.bias is not None]
            self.bias = torch.cat(biases) if len(biases) == len(self.linears) else None
            for linear, columns in zip(self.linears, self.columns(), strict=True):
                linear.weight.data = self.weight[columns]
                if self.bias is not None and linear.bias is not None:
                    linear.bias.data = self.bias[columns]

    def hold(self) -> None:
        """Hold the stacks for a fused forward: the projections' weights as they are where they are still stacked
        (changed in place or not), stacked again where any was replaced."""
        weight = stacked_view([linear.weight.data for linear in self.linears])
        biases = [linear.bias.data for linear in self.linears if linear.bias is not None]
        bias = stacked_view(biases) if len(biases) == len(self.linears) else None
        if weight is None or (biases and bias is None):
            self.restack()
        else:
            self.weight, self.bias = weight, bias

    def release(self) -> None:
        """Let the stacks go (the projections' weights keep their storage)."""
        self.weight = self.bias = self.output = None

    def columns(self) -> tuple[slice, ...]:
        """Each projection's columns of the stacked product."""
        bounds, start = [], 0
        for linear in self.linears:
            bounds.append(slice(start, start + linear.out_features))
            start += linear.out_features
        return tuple(bounds)


class PackPart(torch.nn.Module):
    """One projection of a :class:`Pack` in a fused forward: the ``first`` computes the stacked product and keeps it
    on the pack, every part returns its ``columns`` of it, and the ``last`` lets it go."""

    def __init__(self, pack: Pack, columns: slice, role: str) -> None:
        super().__init__()
        self.pack, self.columns, self.role = pack, columns, role  # a slice and a string: constants when compiled

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.role == "first":
            assert self.pack.weight is not None, "a packed projection called outside a fused forward"
            self.pack.output = F.linear(hidden, self.pack.weight, self.pack.bias)
        output = self.pack.output
        assert output is not None, "a packed projection called before the first of its pack"
        if self.role == "last":
            self.pack.output = None
        return output[..., self.columns]


@dataclasses.dataclass(frozen=True)
class Swap:
    """Where a :class:`PackPart` stands in for a projection during fused forwards: ``parent.name``."""

    parent: torch.nn.Module
    name: str
    own: torch.nn.Linear
    part: PackPart


def called_in_order(module: torch.nn.Module, names: tuple[str, ...]) -> bool:
    """Whether ``module``'s forward, by its source, calls each of ``names`` once, in that order, on one argument."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):  # no source to read: not packed
        return False
    calls = re.findall(r"self\.(" + "|".join(names) + r")\(([^()]*)\)", source)
    return [name for name, _ in calls] == list(names) and len({argument.strip() for _, argument in calls}) == 1


def packable(module: torch.nn.Module, names: tuple[str, ...]) -> tuple[torch.nn.Linear, ...] | None:
    """``module``'s projections ``names`` where they can be packed: plain ``nn.Linear`` of one input size, dtype and
    device, all with a bias or none, with no hook and no forward of their own (accelerate's device hooks replace a
    module's forward, which a packed part would skip), called in order on one input."""
    linears = tuple(getattr(module, name, None) for name in names)
    if not all(type(linear) is torch.nn.Linear for linear in linears):
        return None
    plain = [linear for linear in linears if isinstance(linear, torch.nn.Linear)]
    weights = [linear.weight for linear in plain]
    if len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1 or weights[0].device.type == "meta":
        return None
    if len({linear.bias is None for linear in plain}) != 1:
        return None
    if any(linear._forward_hooks or linear._forward_pre_hooks or "forward" in vars(linear) for linear in plain):
        return None
    return tuple(plain) if called_in_order(module, names) else None


def pack_layer(layer: torch.nn.Module) -> tuple[Swap, ...]:
    """Pack every group of :data:`PACKABLE` projections in ``layer`` that can be (:func:`packable`); the swaps that
    put the packs in place for fused forwards."""
    swaps: list[Swap] = []
    for module in layer.modules():
        for names in PACKABLE:
            linears = packable(module, names)
            if linears is None:
                continue
            pack = Pack.of(linears)
            roles = ["middle"] * len(names)
            roles[0], roles[-1] = "first", "last"
            for name, linear, columns, role in zip(names, linears, pack.columns(), roles, strict=True):
                swaps.append(Swap(module, name, linear, PackPart(pack, columns, role)))
    return tuple(swaps)


@contextlib.contextmanager
def packs_in_place(swaps: tuple[Swap, ...]) -> Iterator[None]:
    """``swaps``' parts in place of the projections they stand for, their packs' stacks held (stacked again where
    a weight was replaced), the projections back and the stacks let go afterwards."""
    packs = list({id(swap.part.pack): swap.part.pack for swap in swaps}.values())
    for pack in packs:
        pack.hold()
    for swap in swaps:
        setattr(swap.parent, swap.name, swap.part)
    try:
        yield
    finally:
        for swap in swaps:
            setattr(swap.parent, swap.name, swap.own)
        for pack in packs:
            pack.release()
