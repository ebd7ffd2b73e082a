"""Byte units, the one place kvlab defines them: binary units (KiB, MiB, GiB, TiB) for what memory holds, decimal
ones (KB, MB, GB) for what the articles and datasheets write, and bytes as people read them: three significant
digits in a binary unit, and axis ticks at round values of one unit, so a chart of bytes never reads
"2 3 4 5 6 7 8 9 10 2" or a table "21000000"."""

from __future__ import annotations

import math

#: Binary units: memory chips, tensors and caches come in powers of two.
KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
TIB = 1 << 40
#: Decimal units: what bandwidth datasheets and the articles' "GB" mean (the articles' may also mean GiB, which
#: :func:`gigabytes` shows beside it).
KB = 1e3
MB = 1e6
GB = 1e9

#: Binary units by name, smallest first.
BYTE_UNITS: tuple[tuple[str, int], ...] = (
    ("B", 1),
    ("KiB", KIB),
    ("MiB", MIB),
    ("GiB", GIB),
    ("TiB", TIB),
)
#: Steps of a linear axis, in one unit, times a power of ten.
_NICE_STEPS = (1.0, 2.0, 2.5, 5.0)


def byte_unit(value: float) -> tuple[str, int]:
    """The largest unit that ``value`` (bytes) holds at least once; bytes below one KiB."""
    size = abs(value)
    chosen = BYTE_UNITS[0]
    for unit in BYTE_UNITS:
        if size >= unit[1]:
            chosen = unit
    return chosen


def exact_bytes(count: int) -> str:
    """A byte count to the byte, as the command line prints what it measured: ``2,621,440 B``."""
    return f"{count:,} B"


def format_bytes(value: float, unit: tuple[str, int] | None = None) -> str:
    """``21.0 MiB``, ``512 KiB``, ``1.25 GiB``: three significant digits in ``unit`` (or the value's own unit);
    whole bytes as they are."""
    name, size = unit or byte_unit(value)
    if size == 1:
        return f"{value:,.0f} B"
    scaled = value / size
    digits = max(0, 2 - int(math.floor(math.log10(abs(scaled))))) if scaled else 0
    return f"{scaled:,.{digits}f} {name}"


def gigabytes(size: float) -> str:
    """Bytes in decimal and binary gigabytes, since the articles' "GB" may mean either: ``42.9 GB (40.0 GiB)``."""
    return f"{size / GB:,.1f} GB ({size / GIB:,.1f} GiB)"


def _tick_text(value: float, unit: tuple[str, int]) -> str:
    """A tick's label: the shortest exact form of a round value in ``unit``."""
    return f"{value / unit[1]:,.4g} {unit[0]}"


def byte_ticks(low: float, high: float, log: bool, max_ticks: int = 8) -> tuple[list[float], list[str]]:
    """Tick values (bytes) and labels for an axis spanning ``[low, high]`` bytes.

    A logarithmic axis gets powers of two (``256 KiB``, ``1 MiB``, ``4 MiB``), every second or fourth one when there
    would be more than ``max_ticks``, each labelled in its own unit. A linear axis gets steps of 1, 2, 2.5 or 5 times
    a power of ten in the unit of ``high``, from the step at or below ``low``.
    """
    low, high = float(min(low, high)), float(max(low, high))
    if log:
        if high <= 0:
            return [], []
        first = math.floor(math.log2(max(low, 1.0)))
        last = math.ceil(math.log2(high))
        stride = max(1, math.ceil((last - first + 1) / max_ticks))
        values = [float(2**power) for power in range(last - (last - first) // stride * stride, last + 1, stride)]
        return values, [_tick_text(value, byte_unit(value)) for value in values]
    unit = byte_unit(max(abs(low), abs(high)))
    bottom, top = low / unit[1], high / unit[1]
    wanted = max(top - bottom, 1e-9) / max(max_ticks - 1, 1)
    magnitude = 10.0 ** math.floor(math.log10(wanted))
    step = next(nice * magnitude for nice in (*_NICE_STEPS, 10.0) if nice * magnitude >= wanted)
    first, last = math.floor(bottom / step + 1e-9), math.ceil(top / step - 1e-9)
    values = [index * step * unit[1] for index in range(first, last + 1)]
    return values, [_tick_text(value, unit) for value in values]


def byte_axis(low: float, high: float, log: bool, max_ticks: int = 8) -> dict[str, object]:
    """A plotly axis (``xaxis=...``/``yaxis=...`` keywords) for values in bytes: log or linear, labelled in binary
    units at round ticks (:func:`byte_ticks`)."""
    values, labels = byte_ticks(low, high, log, max_ticks)
    return {"type": "log" if log else "linear", "tickvals": values, "ticktext": labels}
