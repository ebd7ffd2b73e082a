"""GPUs the calculator can price on, with datasheet memory, bandwidth and compute, and example prices.

Memory is the datasheet capacity in GiB (memory chips come in binary sizes); the device reports a little less
once the driver has taken its share, which the memory reserve of
:func:`~kvlab.costs.formulas.sequences_that_fit` covers. Bandwidth is the datasheet peak in decimal bytes per
second. ``peak_flops`` is the dense (no sparsity) BF16 tensor-core rate, used only to price prefill.

The prices per hour are round example figures in the range of public on-demand cloud list prices for one GPU,
in US dollars. They are not quotes: they vary by provider, region, commitment and month, so edit them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvlab.errors import KvlabError
from kvlab.units import GIB

#: The sentence for a GPU figure that is not a finite number.
NOT_FINITE = "GPU memory, bandwidth, FLOP rate and price must be finite numbers."
#: Upper bounds on a GPU's memory (bytes), bandwidth (bytes/s), dense FLOP/s and price per hour: a thousand times
#: today's largest, so that a typo is one sentence instead of an overflow.
MOST_GPU_FIGURES = (float(1 << 50), 1e16, 1e19, 1e6)


@dataclass(frozen=True)
class GpuSpec:
    """One GPU: memory in bytes, bandwidth in bytes/s, dense BF16 FLOP/s and an example price per hour."""

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    peak_flops: float
    price_per_hour: float
    source: str = ""

    def __post_init__(self) -> None:
        figures = (self.memory_bytes, self.bandwidth_bytes_per_s, self.peak_flops, self.price_per_hour)
        if not all(math.isfinite(value) for value in figures):
            raise KvlabError(NOT_FINITE)
        if min(self.memory_bytes, self.bandwidth_bytes_per_s, self.peak_flops) <= 0 or self.price_per_hour < 0:
            raise KvlabError("GPU memory, bandwidth and FLOP rate must be positive, and the price not negative.")
        for value, most, what in zip(figures, MOST_GPU_FIGURES, ("memory", "bandwidth", "FLOP rate", "price")):
            if value > most:
                raise KvlabError(f"A GPU's {what} of {value:.3g} is beyond any GPU (at most {most:.3g}).")


_PRESETS: tuple[GpuSpec, ...] = (
    GpuSpec("A100 40GB SXM", 40 * GIB, 1.555e12, 312e12, 1.29, "NVIDIA A100 datasheet"),
    GpuSpec("A100 80GB SXM", 80 * GIB, 2.039e12, 312e12, 1.79, "NVIDIA A100 datasheet"),
    GpuSpec("H100 SXM 80GB", 80 * GIB, 3.35e12, 989e12, 2.99, "NVIDIA H100 datasheet"),
    GpuSpec("H100 PCIe 80GB", 80 * GIB, 2.0e12, 756e12, 2.49, "NVIDIA H100 datasheet"),
    GpuSpec("H200 141GB", 141 * GIB, 4.8e12, 989e12, 3.49, "NVIDIA H200 datasheet"),
    GpuSpec("L40S 48GB", 48 * GIB, 864e9, 362.05e12, 0.99, "NVIDIA L40S datasheet"),
    GpuSpec("RTX 4090 24GB", 24 * GIB, 1.008e12, 165.2e12, 0.40, "NVIDIA Ada Lovelace architecture whitepaper"),
    GpuSpec(
        "Laptop 16GB (RTX 4090 Laptop GPU)",
        16 * GIB,
        576e9,
        79.4e12,
        0.05,
        "NVIDIA laptop specifications (256-bit GDDR6, 2,040 MHz top boost); 576 GB/s at 18 Gbps per pin and "
        "76 SMs × 512 FLOP/clock × 2.04 GHz derived from them; the price is the electricity of about 150 W",
    ),
)

GPU_PRESETS: dict[str, GpuSpec] = {preset.name: preset for preset in _PRESETS}
"""Presets by display name; copy one with :func:`dataclasses.replace` to edit it."""
