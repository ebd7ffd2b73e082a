"""The pure parts of ``bench/heap_gpu.py`` that its GPU figures rest on: where the device waited in a profile, put
down to the host's steps; the stream's chunk kernel options switched for a trial and put back; how near two scorings
of the slots are."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from bench_scripts import bench_script
from torch.autograd import DeviceType


@pytest.fixture(scope="module")
def heap_gpu():
    with bench_script("heap_gpu") as module:
        yield module


def event(name: str, device: DeviceType, start: float, end: float) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))


def test_the_devices_idle_stretches_are_put_down_to_the_host_step_that_ended_them(heap_gpu):
    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    events = [
        event("kvlab: forward", cpu, 0, 1000),
        event("kvlab: eviction", cpu, 1000, 1300),
        event("cudaLaunchKernel", cpu, 10, 15),
        event("cudaDeviceSynchronize", cpu, 1300, 1500),
        event("gemm", cuda, 20, 500),
        event("attention", cuda, 400, 600),  # overlaps the gemm: busy once
        event("topk", cuda, 1250, 1260),  # 650 us idle before it, launched during the eviction
        event("copy", cuda, 1262, 1270),  # 2 us idle
        event("replay", cuda, 3270, 3300),  # 2,000 us idle, launched outside any step
    ]
    table = heap_gpu.idle_table(SimpleNamespace(events=lambda: events))
    assert table["span_ms"] == 3.3 and table["busy_ms"] == round((580 + 10 + 8 + 30) / 1000, 1)
    assert table["idle_ms_by_host_step"] == {"between steps": 2.0, "kvlab: eviction": 0.7}
    assert table["idle_ms_by_stretch"]["<1000 us"] == 0.7 and table["idle_ms_by_stretch"]["<10000 us"] == 2.0
    assert [call["name"] for call in table["runtime_calls"]] == ["cudaDeviceSynchronize", "cudaLaunchKernel"]
    assert heap_gpu.idle_table(SimpleNamespace(events=lambda: events[:4])) == {}  # no kernels: a CPU run


def test_a_trials_chunk_options_are_added_to_kvlabs_and_put_back(heap_gpu):
    from kvlab.attention import flex_chunks

    shipped = dict(flex_chunks.CHUNK_KERNEL)
    with heap_gpu.chunk_options({"num_stages": 4}):
        assert flex_chunks.CHUNK_KERNEL == {**shipped, "num_stages": 4}
    assert flex_chunks.CHUNK_KERNEL == shipped
    with heap_gpu.chunk_options(None):
        assert flex_chunks.CHUNK_KERNEL == shipped


def test_two_scorings_agree_when_they_rank_the_same_top_tenth(heap_gpu):
    """How near the kernels' sums are to PyTorch's (``--part sums``): the largest difference relative to the largest
    score, and the share of each KV head's top 10% that both rank there."""
    import torch

    scores = torch.arange(40.0).view(1, 2, 20)
    same = heap_gpu.agreement(scores + 1e-3, scores)
    assert same["top 10% in common"] == 1.0 and same["largest difference / largest score"] == pytest.approx(
        1e-3 / 39, rel=0.01
    )
    swapped = scores.clone()
    swapped[0, 0, [0, 19]] = swapped[0, 0, [19, 0]]  # the first head ranks slots 0 and 18 first, not 19 and 18
    assert heap_gpu.agreement(swapped, scores)["top 10% in common"] == 0.75
