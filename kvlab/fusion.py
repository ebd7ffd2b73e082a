"""Pure tensor functions fused into a few kernels on CUDA, for the fixed shapes of static decode steps.

A static decode step is replayed from a CUDA graph, so its cost is its kernels: dozens of tiny elementwise ones per
layer (a mask's tables, an eviction's ranking keys) cost more than the arithmetic they do. ``torch.compile`` with
fixed shapes fuses each such function into one or two Triton kernels, compiled once per shape and reused by every
layer of that shape. Elsewhere (a CPU, or CUDA without Triton) the function runs as written, with the same results.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
from torch.utils._triton import has_triton  # the check torch's own compiler makes before using Triton

#: Compiled variants kept per function: one per shape (a layer's capacity, heads, head size) and per constant
#: (an eviction's count, what is observed).
RECOMPILE_LIMIT = 64


def fuses(device_type: str) -> bool:
    """Whether functions compile to fused kernels on a ``device_type`` device: CUDA with Triton."""
    return device_type == "cuda" and torch.cuda.is_available() and has_triton()


@functools.cache
def fused(device_type: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` as a ``device_type`` device runs it in a static step: compiled for fixed shapes where
    :func:`fuses`, as written elsewhere."""
    if not fuses(device_type):
        return function
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(function, dynamic=False, fullgraph=True)
