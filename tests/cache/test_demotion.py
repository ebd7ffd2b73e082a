"""Demotion tiers: evicted tokens kept in CPU memory and an offload file, recalled page by page
(:mod:`kvlab.cache.demotion`, :mod:`kvlab.cache.offload`), run end to end on tiny random models."""

from __future__ import annotations

import errno
import os
import stat

import numpy as np
import pytest
import torch
from tiny_models import prompt, tiny_model

from kvlab.budget import Budget
from kvlab.cache import offload
from kvlab.cache.demotion import Demotion, physical_memory
from kvlab.cache.offload import HostStore, OffloadFile, PageShape
from kvlab.cache.spec import DemotionSpec
from kvlab.engine.generation import generate
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError
from kvlab.models.loading import wrap_model
from kvlab.policies import configure

BUDGET = 12
PAGE = 4
#: Bytes of one page slot over the 3 layers of the tiny models (2 KV heads x 16 dims, float32, 4 tokens).
PAGE_SLOT_BYTES = 3 * PageShape(1, 2, PAGE, 16, torch.float32).page_bytes()


@pytest.fixture(scope="module")
def llama():
    return wrap_model(tiny_model("llama"))


@pytest.fixture(scope="module")
def gemma2():
    return wrap_model(tiny_model("gemma2"))


def run(loaded, name: str, budget: int | None, mode: str = "prefill", **params):
    spec = RunSpec.of(
        configure(name, **params), None if budget is None else Budget(tokens=budget), mode=mode, max_new_tokens=8
    )
    return generate(loaded, prompt(1, 64), spec, prompt(1, 6, seed=3))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, to compare floats bit for bit."""
    return tensor.contiguous().view(torch.int8)


def mib(pages: int) -> float:
    """A tier budget holding ``pages`` page slots in each layer of the tiny models."""
    return pages * PAGE_SLOT_BYTES / (1 << 20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_written_to_memory_and_to_the_file_read_back_bit_for_bit(tmp_path, dtype):
    shape = PageShape(2, 3, PAGE, 8, dtype)
    keys = torch.randn(5, 2, 3, PAGE, 8).to(dtype)
    values = torch.randn(5, 2, 3, PAGE, 8).to(dtype)
    positions = torch.randint(0, 10_000, (5, 2, 3, PAGE), dtype=torch.int32)
    slots = np.array([4, 0, 2, 7, 1])
    file = OffloadFile(2 * 8 * shape.page_bytes(), directory=str(tmp_path))
    for store in (HostStore(shape, capacity=8, pinned=False), file.map([shape, shape], capacity=8)[1]):
        store.write(slots, keys, values, positions)
        rows = torch.tensor([2 * shape.rows + 5, 4 * shape.rows + 0, 7 * shape.rows + 3])  # (slot 2, row 5), ...
        out = (
            torch.empty(3, PAGE, 8, dtype=dtype),
            torch.empty(3, PAGE, 8, dtype=dtype),
            torch.empty(3, PAGE, dtype=torch.int32),
        )
        store.read_rows(rows, out)
        flat = [t.reshape(5 * shape.rows, *t.shape[3:]) for t in (keys, values, positions)]
        expected_rows = torch.tensor([2 * shape.rows + 5, 0 * shape.rows + 0, 3 * shape.rows + 3])  # in write order
        for got, written in zip(out, flat):
            assert torch.equal(_bits(got), _bits(written[expected_rows]))
    path = file.path
    assert path.exists()
    file.close()
    assert not path.exists()


def test_an_offload_file_is_private_reserved_and_a_dead_runs_file_is_removed(tmp_path, monkeypatch):
    shape = PageShape(1, 2, PAGE, 8, torch.float16)
    folder = offload.private_directory(tmp_path)
    stale = folder / f"{offload.FILE_PREFIX}999999999-abc.kv"  # no process has this pid
    stale.write_bytes(b"prompt KV of a run killed with -9")
    alive = folder / f"{offload.FILE_PREFIX}{os.getpid()}-abc.kv"
    alive.write_bytes(b"a live run's pages")
    file = OffloadFile(4 * shape.page_bytes(), directory=str(tmp_path))
    assert not stale.exists() and alive.exists()
    assert file.path.parent == folder and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(file.path.stat().st_mode) == 0o600
    assert file.path.stat().st_blocks * 512 >= 4 * shape.page_bytes()  # reserved, not sparse
    file.close()

    def full_disk(handle, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(offload.os, "posix_fallocate", full_disk)
    with pytest.raises(KvlabError, match="Could not reserve .* for the offload file .*No space left on device"):
        OffloadFile(4 * shape.page_bytes(), directory=str(tmp_path))
    assert sorted(folder.iterdir()) == [alive]  # nothing half-made left behind


def test_an_offload_directory_that_is_not_this_users_own_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / f"kvlab-offload-{os.getuid()}").symlink_to(elsewhere)
    with pytest.raises(KvlabError, match="is not a directory of this user"):
        OffloadFile(1024, directory=str(tmp_path))


def test_a_tier_larger_than_the_machine_is_one_sentence():
    for huge in (1e300, 1e308):
        with pytest.raises(KvlabError, match="cpu_tier_mib"):
            configure("h2o", cpu_tier_mib=huge)
    memory = physical_memory()
    assert memory is not None
    with pytest.raises(KvlabError, match="is more than this machine's .* of memory; lower cpu_tier_mib"):
        Demotion(DemotionSpec(cpu_bytes=2 * memory, disk_bytes=0), num_layers=2)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["prefill", "streaming"])
@pytest.mark.parametrize(
    "tiers",
    [
        {"cpu_tier_mib": 1.0},
        {"disk_tier_mib": 1.0},
        {"cpu_tier_mib": 0.0, "disk_tier_mib": 1.0},
        {"cpu_tier_mib": "small", "disk_tier_mib": 1.0},
    ],
    ids=["cpu", "disk", "disk-only", "cpu-then-disk"],
)
def test_recalling_every_page_generates_what_the_full_cache_does(llama, mode, tiers, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_OFFLOAD_DIR", str(tmp_path))
    tiers = {name: mib(2) if value == "small" else value for name, value in tiers.items()}
    full = run(llama, "full", None)
    plain = run(llama, "h2o", BUDGET, mode)
    demoted = run(llama, "h2o", BUDGET, mode, recall_pages=1000, page_tokens=PAGE, **tiers)
    assert plain.tokens != full.tokens  # the budget matters
    assert demoted.tokens == full.tokens
    report = demoted.demotion
    assert report is not None and report.demoted_pages > 0 and report.dropped_pages == 0
    if tiers.get("cpu_tier_mib") == mib(2):  # the CPU tier fills up; the rest goes to the file
        assert report.cpu_bytes == 2 * PAGE_SLOT_BYTES and report.disk_bytes > 0
        if mode == "streaming":  # pages demoted later push the least recently used ones down
            assert report.to_disk_pages > 0
    assert list(tmp_path.glob("**/*.kv")) == []  # the run's offload file went with it


@pytest.mark.slow
def test_sliding_window_layers_demote_nothing_and_recall_still_matches_the_full_cache(gemma2):
    full = run(gemma2, "full", None)
    demoted = run(gemma2, "snapkv", BUDGET, window=4, cpu_tier_mib=1.0, recall_pages=1000, page_tokens=PAGE)
    assert demoted.tokens == full.tokens


def test_tier_budgets_hold_and_what_fits_nowhere_is_dropped(llama):
    result = run(
        llama, "h2o", BUDGET, "streaming", recall_pages=2, page_tokens=PAGE, cpu_tier_mib=mib(2), disk_tier_mib=mib(3)
    )
    report = result.demotion
    assert report is not None
    assert report.cpu_bytes <= mib(2) * (1 << 20) and report.disk_bytes <= mib(3) * (1 << 20)
    assert report.cpu_bytes == 2 * PAGE_SLOT_BYTES and report.disk_bytes == 3 * PAGE_SLOT_BYTES
    assert report.dropped_pages == report.demoted_pages - 3 * 5 * 2  # all but the 5 that fit (3 layers, 2 KV heads)
    assert report.to_disk_pages > 0


def test_pages_kept_on_the_gpu_are_not_fetched_again(llama):
    kept = run(llama, "h2o", BUDGET, recall_pages=3, page_tokens=PAGE, cpu_tier_mib=1.0).demotion
    refetched = run(llama, "h2o", BUDGET, recall_pages=3, page_tokens=PAGE, cpu_tier_mib=1.0, promote=False).demotion
    assert kept is not None and refetched is not None
    assert refetched.pages_per_token == 3 * 3 * 2  # every pass fetches 3 pages per layer (3) and KV head (2)
    assert kept.pages_per_token is not None and kept.pages_per_token < refetched.pages_per_token


def test_a_page_is_recalled_by_the_query_its_keys_answer():
    demotion = Demotion(DemotionSpec(cpu_bytes=1 << 20, disk_bytes=0, page_tokens=2, recall_pages=1), num_layers=1)
    keys = torch.zeros(1, 1, 8, 4)
    keys[0, 0, 4:6, 2] = 5.0  # the third page's keys point along dimension 2
    keys[0, 0, 0:2, 0] = 5.0
    demotion.demote(0, keys, torch.randn(1, 1, 8, 4), torch.arange(8, dtype=torch.int32).view(1, 1, 8))
    query = torch.zeros(1, 2, 1, 4)
    query[0, :, 0, 2] = 1.0
    recalled = demotion.recall(0, query, decoding=True)
    assert recalled is not None
    assert recalled[2][0, 0].tolist() == [4, 5, -1, -1]  # its page, then the empty partial page
    assert torch.equal(recalled[0][0, 0, :2], keys[0, 0, 4:6])


@pytest.mark.slow
def test_demotion_decodes_eagerly_and_equals_itself_when_static_is_asked(llama):
    policy = configure("h2o", recall_pages=2, page_tokens=PAGE, cpu_tier_mib=1.0)
    eager, static = (
        generate(llama, prompt(1, 64), RunSpec.of(policy, Budget(tokens=BUDGET), max_new_tokens=8, static=flag))
        for flag in (False, True)
    )
    assert eager.tokens == static.tokens and static.decode_graphs == 0


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"cpu_tier_mib": 1.0, "hot": 0.5, "key_bits": 4}, "frozen layers"),
        ({"cpu_tier_mib": -1.0}, "cpu_tier_mib"),
        ({"disk_tier_mib": 1.0, "page_summary": "median"}, "page_summary"),
    ],
)
def test_bad_demotion_settings_are_one_sentence(params, words):
    with pytest.raises(KvlabError, match=words):
        configure("snapkv", **params)
