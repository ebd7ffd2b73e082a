"""Demotion instead of deletion: a policy's losers leave the GPU for pinned CPU memory, then for a memory-mapped file,
and pages of them come back for a forward pass when its queries need them.

Each layer groups the tokens it demotes into pages of ``page_tokens`` tokens per sequence and KV head (a partly
filled page waits on the GPU, attended to by every query, until it is full). Of each page the GPU keeps a small
summary, the element-wise minimum and maximum of its keys (Quest's page metadata,
:func:`kvlab.cache.sparse.quest_bounds`) or their mean, and the page itself goes to a tier: pinned CPU memory while the
CPU budget lasts, then the file (:mod:`kvlab.cache.offload`); when both are full the least recently used pages move down
(CPU to file) and out (deleted).

Every forward pass once a layer has demoted pages recalls some: its queries score every page by the summary (the
upper bound of ``q.k`` over the page, the largest over the pass's queries and the query heads of each KV head), the
``recall_pages`` best of each sequence and KV head are fetched to the GPU and attended to beside the heap's tokens,
masked by their original positions like any slot. With ``promote`` a fetched page stays on the GPU while the
selection keeps choosing it (a page cache of ``recall_pages`` pages per KV head: only new choices move); without it
every pass fetches its pages anew. With ``prefetch`` a pass attends to the pages the previous pass of the layer chose
and starts the next fetch as soon as its own queries are known (FreeKV's speculative retrieval: consecutive queries
need nearly the same pages), so the copy overlaps the rest of the step on a GPU. Recalling every page attends to
every token a full cache would (tested: the same generation).

What moves is counted on the host (pages and bytes fetched, demoted, moved to the file, dropped) and timed (the
device synchronised around each recall): the engine reports them per decoded token beside the bytes of each tier.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvlab.cache.layer import FREE, HeapLayer, Slots
from kvlab.cache.offload import FileRegion, HostStore, OffloadFile, PageShape
from kvlab.cache.sparse import quest_bounds
from kvlab.cache.spec import DemotionSpec
from kvlab.errors import KvlabError
from kvlab.units import format_bytes

#: Where demotion holds bytes, as runs report them: on the GPU beside the heap, in CPU memory, in the offload file.
TIERS: tuple[str, ...] = ("gpu", "cpu", "disk")
_GONE, _CPU, _DISK = 0, 1, 2


@dataclass
class Moves:
    """What moved between the tiers, counted on the host: pages and bytes (keys, values and positions) demoted from
    the GPU, moved from CPU memory to the file, dropped for good, and fetched back (in all, and while decoding), with
    the seconds the recalls took while decoding. A page is counted per sequence and KV head (a recall fetches
    different pages for each)."""

    demoted_pages: int = 0
    demoted_bytes: int = 0
    to_disk_pages: int = 0
    dropped_pages: int = 0
    fetched_pages: int = 0
    fetched_bytes: int = 0
    decode_fetched_pages: int = 0
    decode_fetched_bytes: int = 0
    decode_recall_seconds: float = 0.0


@dataclass(frozen=True)
class DemotionReport:
    """A run's tiers as it ended and what moved: bytes demotion holds on the GPU (page summaries, partial pages,
    recalled pages), in CPU memory and in the file (pages' keys, values and positions); pages demoted, moved from CPU
    memory to the file, and dropped; pages and bytes fetched back in all; and per decoded token the pages and bytes
    fetched and the seconds recalls took (choosing, gathering and copying, the device synchronised)."""

    gpu_bytes: int
    cpu_bytes: int
    disk_bytes: int
    demoted_pages: int
    to_disk_pages: int
    dropped_pages: int
    fetched_pages: int
    fetched_bytes: int
    pages_per_token: float | None
    bytes_per_token: float | None
    recall_seconds_per_token: float | None


@dataclass
class _Resident:
    """The pages a layer attends to besides its heap: their ids ``(batch, kv_heads, k)`` on the host (-1: none) and
    their tokens on the GPU, flat per (sequence, KV head, page)."""

    ids: np.ndarray
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    ready: torch.cuda.Event | None = None


@dataclass
class DemotedLayer:
    """One layer's demoted pages: the waiting partial page and the summaries on the GPU, the pages in their tiers."""

    shape: PageShape
    device: torch.device
    host: HostStore
    region: FileRegion | None
    disk_capacity: int
    pages: int = 0
    pending: int = 0
    tier: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    slot: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    last_used: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    summaries: list[torch.Tensor] = field(default_factory=list)
    alive: torch.Tensor | None = None
    resident: _Resident | None = None
    waiting: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    staging: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        s = self.shape
        tokens = (s.batch, s.kv_heads, s.tokens)
        self.waiting = (
            torch.zeros(*tokens, s.head_dim, dtype=s.dtype, device=self.device),
            torch.zeros(*tokens, s.head_dim, dtype=s.dtype, device=self.device),
            torch.full(tokens, FREE, dtype=torch.int32, device=self.device),
        )


class Demotion:
    """The demotion tiers of one generation's heap, shared by its :class:`DemotingLayer` objects."""

    def __init__(self, spec: DemotionSpec, num_layers: int) -> None:
        memory = physical_memory()
        if memory is not None and spec.cpu_bytes > memory:
            raise KvlabError(
                f"A CPU tier of {format_bytes(spec.cpu_bytes)} is more than this machine's {format_bytes(memory)} of "
                "memory; lower cpu_tier_mib."
            )
        self.spec = spec
        self.num_layers = num_layers
        self.layers: list[DemotedLayer | None] = [None] * num_layers
        self.moves = Moves()
        #: The offload file, its bytes reserved now, so that a disk without the room is refused before any work.
        self.file = OffloadFile(spec.disk_bytes) if spec.disk_bytes else None
        self._clock = 0
        self._side: torch.cuda.Stream | None = None

    # --- demoting ----------------------------------------------------------------------------------------------

    def demote(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Take a layer's evicted tokens (``(batch, kv_heads, n, head_dim)`` and their positions): complete pages go
        to the tiers with their summaries, the rest waits on the GPU for the next eviction."""
        layer = self._layer(layer_idx, keys)
        assert layer.waiting is not None
        size = layer.shape.tokens
        joined = [
            torch.cat([held[:, :, : layer.pending], new], dim=2)
            for held, new in zip(layer.waiting, (keys, values, positions))
        ]
        total = layer.pending + keys.shape[2]
        full = total // size
        if full:
            self._store(layer, [tensor[:, :, : full * size] for tensor in joined], full)
        layer.pending = total - full * size
        for held, tensor in zip(layer.waiting, joined):
            held[:, :, : layer.pending] = tensor[:, :, full * size :]
        layer.waiting[2][:, :, layer.pending :] = FREE

    def _layer(self, layer_idx: int, like: torch.Tensor) -> DemotedLayer:
        """The layer's pages, set up at its first demotion (shapes are known from the first evicted tokens)."""
        layer = self.layers[layer_idx]
        if layer is not None:
            return layer
        batch, kv_heads, _, head_dim = like.shape
        shape = PageShape(batch, kv_heads, self.spec.page_tokens, head_dim, like.dtype)
        share = self.num_layers * shape.page_bytes()
        cpu_capacity, disk_capacity = self.spec.cpu_bytes // share, self.spec.disk_bytes // share
        if self.file is not None and disk_capacity and not self.file.regions:
            self.file.map([shape] * self.num_layers, disk_capacity)
        region = self.file.regions[layer_idx] if self.file is not None and disk_capacity else None
        host = HostStore(shape, cpu_capacity, pinned=like.device.type == "cuda")
        layer = DemotedLayer(shape, like.device, host, region, disk_capacity)
        self.layers[layer_idx] = layer
        return layer

    def _store(self, layer: DemotedLayer, tokens: list[torch.Tensor], count: int) -> None:
        """Summarise ``count`` complete pages of ``tokens`` (keys, values, positions) on the GPU and place them in
        the tiers."""
        s = layer.shape
        paged = [t.reshape(s.batch, s.kv_heads, count, s.tokens, *t.shape[3:]) for t in tokens]
        first = layer.pages
        self._grow(layer, first + count)
        summaries = (
            [paged[0].amin(dim=3), paged[0].amax(dim=3)]
            if self.spec.summary == "minmax"
            else [paged[0].float().mean(dim=3).to(s.dtype)]
        )
        for held, summary in zip(layer.summaries, summaries):
            held[:, :, first : first + count] = summary
        assert layer.alive is not None
        layer.alive[first : first + count] = True
        layer.pages += count
        ids = np.arange(first, first + count)
        layer.last_used[ids] = self._clock
        # page-major and contiguous on the device (one layer's pages at a time), so the host copy is one block
        on_host = [t.permute(2, 0, 1, 3, *range(4, t.dim())).contiguous().cpu() for t in paged]
        self.moves.demoted_pages += count * s.rows
        self.moves.demoted_bytes += count * s.page_bytes()
        self._place(layer, ids, on_host)

    def _grow(self, layer: DemotedLayer, pages: int) -> None:
        """Room for ``pages`` summaries and page records (doubling)."""
        have = layer.tier.shape[0]
        if pages <= have:
            return
        size = max(pages, 2 * have, 64)
        s = layer.shape
        grown = []
        for index in range(1 if self.spec.summary == "mean" else 2):
            new = torch.zeros(s.batch, s.kv_heads, size, s.head_dim, dtype=s.dtype, device=layer.device)
            if layer.summaries:
                new[:, :, :have] = layer.summaries[index]
            grown.append(new)
        layer.summaries = grown
        alive = torch.zeros(size, dtype=torch.bool, device=layer.device)
        if layer.alive is not None:
            alive[:have] = layer.alive
        layer.alive = alive
        layer.tier = np.concatenate([layer.tier, np.zeros(size - have, np.int8)])
        layer.slot = np.concatenate([layer.slot, np.full(size - have, -1, np.int64)])
        layer.last_used = np.concatenate([layer.last_used, np.zeros(size - have, np.int64)])

    def _place(self, layer: DemotedLayer, ids: np.ndarray, pages: list[torch.Tensor]) -> None:
        """Put new pages (``ids``, their tensors on the host) in the CPU tier, the least recently used pages there
        moving to the file, and the least recently used ones of the file dropped: each tier keeps the most recently
        used pages that fit."""
        in_cpu = np.flatnonzero(layer.tier[: layer.pages] == _CPU)
        kept_cpu, down = _most_recent(layer, in_cpu, ids, layer.host.capacity)
        new_in_cpu = np.isin(ids, kept_cpu)
        leaving = down[~np.isin(down, ids)]  # pages that were in CPU memory and move to the file
        moving = layer.host.read_pages(layer.slot[leaving]) if len(leaving) else None
        self._release(layer, leaving)
        slots = _free_slots(layer, _CPU, layer.host.capacity, int(new_in_cpu.sum()))
        layer.host.write(slots, *(page[torch.from_numpy(new_in_cpu)] for page in pages))
        self._assign(layer, ids[new_in_cpu], _CPU, slots)
        to_file = np.concatenate([leaving, ids[~new_in_cpu]])
        if not len(to_file):
            return
        candidates = np.flatnonzero(layer.tier[: layer.pages] == _DISK)
        kept_file, dropped = _most_recent(layer, candidates, to_file, layer.disk_capacity)
        old_dropped = dropped[np.isin(dropped, candidates)]
        self._release(layer, old_dropped)
        assert layer.alive is not None
        layer.alive[torch.from_numpy(dropped).to(layer.device)] = False
        self.moves.dropped_pages += len(dropped) * layer.shape.rows
        arriving = to_file[np.isin(to_file, kept_file)]
        if not len(arriving) or layer.region is None:
            return
        self.moves.to_disk_pages += int(np.isin(arriving, leaving).sum()) * layer.shape.rows
        parts: list[tuple[np.ndarray, list[torch.Tensor]]] = []
        if moving is not None:
            parts.append((leaving, list(moving)))
        parts.append((ids[~new_in_cpu], [page[torch.from_numpy(~new_in_cpu)] for page in pages]))
        for part_ids, tensors in parts:
            chosen = np.isin(part_ids, arriving)
            if not chosen.any():
                continue
            slots = _free_slots(layer, _DISK, layer.disk_capacity, int(chosen.sum()))
            layer.region.write(slots, *(t[torch.from_numpy(chosen)] for t in tensors))
            self._assign(layer, part_ids[chosen], _DISK, slots)

    @staticmethod
    def _release(layer: DemotedLayer, ids: np.ndarray) -> None:
        layer.tier[ids] = _GONE
        layer.slot[ids] = -1

    @staticmethod
    def _assign(layer: DemotedLayer, ids: np.ndarray, tier: int, slots: np.ndarray) -> None:
        layer.tier[ids] = tier
        layer.slot[ids] = slots

    # --- recalling ---------------------------------------------------------------------------------------------

    def recall(
        self, layer_idx: int, query: torch.Tensor, decoding: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The demoted tokens a forward pass of the layer attends to besides the heap, ``(batch, kv_heads, n,
        head_dim)`` keys and values and their positions (:data:`FREE` where a recalled slot holds nothing), or
        ``None`` before the layer demoted anything. ``query`` is the pass's ``(batch, q_heads, queries, head_dim)``
        after RoPE."""
        layer = self.layers[layer_idx]
        if layer is None:
            return None
        self._clock += 1
        _synchronize_current(layer.device)  # the step's own work so far is not the recall's
        started = time.perf_counter()
        before = self.moves.fetched_pages, self.moves.fetched_bytes
        if layer.pages:
            if not self.spec.prefetch or layer.resident is None:
                layer.resident = self._fetch(layer, self._select(layer, query), layer.resident, None)
            current = layer.resident
            if current.ready is not None:  # a prefetch still copying is waited for (and timed) here
                current.ready.synchronize()
            if self.spec.prefetch:  # the next pass's pages, chosen by this pass's queries, while the step goes on
                layer.resident = self._fetch(layer, self._select(layer, query), current, self._stream(layer.device))
            elif not self.spec.promote:
                layer.resident = None
            parts = [(current.keys, current.values, current.positions)]
        else:
            parts = []
        assert layer.waiting is not None
        parts.append(layer.waiting)
        _synchronize_current(layer.device)  # a prefetch started here goes on copying beside the step
        if decoding:
            self.moves.decode_recall_seconds += time.perf_counter() - started
            self.moves.decode_fetched_pages += self.moves.fetched_pages - before[0]
            self.moves.decode_fetched_bytes += self.moves.fetched_bytes - before[1]
        return (
            torch.cat([part[0] for part in parts], dim=2),
            torch.cat([part[1] for part in parts], dim=2),
            torch.cat([part[2] for part in parts], dim=2),
        )

    def _select(self, layer: DemotedLayer, query: torch.Tensor) -> np.ndarray:
        """The ids of the pages each sequence and KV head recalls, ``(batch, kv_heads, recall_pages)`` on the host,
        best first (-1 where fewer pages are alive): the largest summary score over the queries and query heads."""
        s = layer.shape
        batch, q_heads, queries, head_dim = query.shape
        # in the cache's dtype, as Quest's kernel scores pages in half precision: converting every summary to float32
        # at every pass would cost more than the choice itself
        grouped = query.reshape(batch, s.kv_heads, q_heads // s.kv_heads * queries, head_dim).to(s.dtype)
        pages = layer.pages
        if self.spec.summary == "minmax":
            low, high = (summary[:, :, :pages] for summary in layer.summaries)
            scores = quest_bounds(grouped, low, high)
        else:
            scores = grouped @ layer.summaries[0][:, :, :pages].transpose(-1, -2)
        assert layer.alive is not None
        best = scores.amax(dim=2).masked_fill(~layer.alive[:pages], float("-inf"))
        top = best.topk(min(self.spec.recall_pages, pages), dim=-1)
        ids = top.indices.masked_fill(top.values == float("-inf"), -1).cpu().numpy()
        layer.last_used[ids[ids >= 0]] = self._clock
        return ids

    def _fetch(
        self, layer: DemotedLayer, ids: np.ndarray, previous: _Resident | None, stream: torch.cuda.Stream | None
    ) -> _Resident:
        """The pages ``ids`` on the GPU: those already there (with ``promote``) copied on the device, the others
        gathered from their tier into pinned memory and copied over (on ``stream`` when given, recording when it is
        done)."""
        s = layer.shape
        rows = ids.size
        flat = ids.reshape(-1)
        reuse = np.full(rows, -1, np.int64)
        if previous is not None and self.spec.promote:
            reuse = _positions_in(previous.ids, ids)
        wanted = (flat >= 0) & (reuse < 0)
        missing = np.flatnonzero(wanted)
        dtype, device = s.dtype, layer.device
        keys = torch.zeros(rows, s.tokens, s.head_dim, dtype=dtype, device=device)
        values = torch.zeros_like(keys)
        positions = torch.full((rows, s.tokens), FREE, dtype=torch.int32, device=device)
        if stream is not None:  # the side stream writes into tensors the current stream has just filled
            stream.wait_stream(torch.cuda.current_stream(device))
        context = torch.cuda.stream(stream) if stream is not None else _no_stream()
        with context:
            if previous is not None and (reuse >= 0).any():
                hits = np.flatnonzero(reuse >= 0)
                destination = torch.from_numpy(hits).to(device)
                source = torch.from_numpy(reuse[hits]).to(device)
                for target, old in zip((keys, values, positions), (previous.keys, previous.values, previous.positions)):
                    target.index_copy_(0, destination, old.reshape(-1, *target.shape[1:]).index_select(0, source))
            if len(missing):
                staged = self._gather(layer, flat[missing], missing, ids.shape[-1])
                destination = torch.from_numpy(missing).to(device, non_blocking=True)
                for target, part in zip((keys, values, positions), staged):
                    target.index_copy_(0, destination, part.to(device, non_blocking=True))
            ready = None
            if stream is not None:
                ready = torch.cuda.Event()
                ready.record(stream)
        self.moves.fetched_pages += len(missing)
        self.moves.fetched_bytes += len(missing) * s.page_bytes() // s.rows
        shape = (s.batch, s.kv_heads, -1)
        return _Resident(
            ids, keys.view(*shape, s.head_dim), values.view(*shape, s.head_dim), positions.view(*shape), ready
        )

    def _gather(
        self, layer: DemotedLayer, pages: np.ndarray, rows: np.ndarray, width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows of ``pages`` gathered from their tiers into the layer's pinned staging tensors: one per recalled row
        ``rows`` of a ``(batch, kv_heads, width)`` choice."""
        s = layer.shape
        count = len(pages)
        staging = layer.staging
        if staging is None or staging[2].shape[0] < count:
            pinned = layer.device.type == "cuda"
            size = max(count, self.spec.recall_pages * s.rows)
            staging = (
                torch.empty(size, s.tokens, s.head_dim, dtype=s.dtype, pin_memory=pinned),
                torch.empty(size, s.tokens, s.head_dim, dtype=s.dtype, pin_memory=pinned),
                torch.empty(size, s.tokens, dtype=torch.int32, pin_memory=pinned),
            )
            layer.staging = staging
        head = rows // width  # recalled rows are laid out (batch, kv_heads, choice): the page row of each
        out = (staging[0][:count], staging[1][:count], staging[2][:count])
        tiers = layer.tier[pages]
        stores: tuple[tuple[int, HostStore | FileRegion | None], ...] = ((_CPU, layer.host), (_DISK, layer.region))
        for tier, store in stores:
            chosen = np.flatnonzero(tiers == tier)
            if not len(chosen) or store is None:
                continue
            page_rows = torch.from_numpy(layer.slot[pages[chosen]] * s.rows + head[chosen])
            part = (
                torch.empty(len(chosen), s.tokens, s.head_dim, dtype=s.dtype),
                torch.empty(len(chosen), s.tokens, s.head_dim, dtype=s.dtype),
                torch.empty(len(chosen), s.tokens, dtype=torch.int32),
            )
            store.read_rows(page_rows, part)
            index = torch.from_numpy(chosen)
            for target, source in zip(out, part):
                target.index_copy_(0, index, source)
        return out

    def _stream(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        return self._side

    # --- figures -----------------------------------------------------------------------------------------------

    def gpu_bytes(self) -> int:
        """Bytes the demotion holds on the GPU: summaries, the waiting partial pages and the recalled pages."""
        total = 0
        for layer in self.layers:
            if layer is None:
                continue
            tensors = [*layer.summaries, *(layer.waiting or ())]
            if layer.resident is not None:
                tensors += [layer.resident.keys, layer.resident.values, layer.resident.positions]
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total

    def cpu_bytes(self) -> int:
        """Bytes of the pages held in CPU memory (keys, values, positions)."""
        return self._tier_bytes(_CPU)

    def disk_bytes(self) -> int:
        """Bytes of the pages held in the file."""
        return self._tier_bytes(_DISK)

    def _tier_bytes(self, tier: int) -> int:
        return sum(
            int((layer.tier[: layer.pages] == tier).sum()) * layer.shape.page_bytes()
            for layer in self.layers
            if layer is not None
        )

    def tier_bytes(self) -> dict[str, int]:
        """Bytes held now in each of :data:`TIERS`."""
        return dict(zip(TIERS, (self.gpu_bytes(), self.cpu_bytes(), self.disk_bytes())))

    def report(self, decode_steps: int) -> DemotionReport:
        """The tiers' bytes now and what moved, per decoded token where a token was decoded."""
        moves = self.moves

        def per_token(total: float) -> float | None:
            return total / decode_steps if decode_steps else None

        return DemotionReport(
            gpu_bytes=self.gpu_bytes(),
            cpu_bytes=self.cpu_bytes(),
            disk_bytes=self.disk_bytes(),
            demoted_pages=moves.demoted_pages,
            to_disk_pages=moves.to_disk_pages,
            dropped_pages=moves.dropped_pages,
            fetched_pages=moves.fetched_pages,
            fetched_bytes=moves.fetched_bytes,
            pages_per_token=per_token(moves.decode_fetched_pages),
            bytes_per_token=per_token(moves.decode_fetched_bytes),
            recall_seconds_per_token=per_token(moves.decode_recall_seconds),
        )

    def close(self) -> None:
        """Remove the file tier's file (the counts stay readable)."""
        if self.file is not None:
            self.file.close()


def _most_recent(
    layer: DemotedLayer, held: np.ndarray, arriving: np.ndarray, capacity: int
) -> tuple[np.ndarray, np.ndarray]:
    """Of the pages a tier ``held`` and those ``arriving``, the ``capacity`` most recently used (the later page
    first among equals) and the others."""
    candidates = np.concatenate([held, arriving])
    if len(candidates) <= capacity:
        return candidates, candidates[:0]
    order = np.lexsort((-candidates, -layer.last_used[candidates]))
    return candidates[order[:capacity]], candidates[order[capacity:]]


def _free_slots(layer: DemotedLayer, tier: int, capacity: int, count: int) -> np.ndarray:
    """``count`` slots of a tier that no page holds, lowest first."""
    taken = np.zeros(capacity, bool)
    held = layer.slot[: layer.pages][layer.tier[: layer.pages] == tier]
    taken[held] = True
    free = np.flatnonzero(~taken)[:count]
    assert len(free) == count, "a tier's placement keeps no more pages than it has slots"
    return free


def _positions_in(previous: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """For every choice in ``ids`` (``(batch, kv_heads, k)``), the flat row of the same page among the ``previous``
    choices of the same sequence and KV head, or -1 (a page chosen anew)."""
    rows = previous.shape[0] * previous.shape[1]
    old = previous.reshape(rows, -1)
    new = ids.reshape(rows, -1)
    match = (new[:, :, None] == old[:, None, :]) & (new[:, :, None] >= 0)
    found = match.any(-1)
    where = match.argmax(-1) + np.arange(rows)[:, None] * old.shape[1]
    return np.where(found, where, -1).reshape(-1)


def _no_stream() -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _synchronize_current(device: torch.device) -> None:
    """Wait for the work queued on the device's current stream (not on the prefetch's side stream)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


@dataclass
class DemotingLayer(HeapLayer):
    """A layer whose evicted tokens are demoted instead of deleted: handed to the run's :class:`Demotion` before
    their slots are freed (not on sliding-window layers, where no query sees them again), and recalled by page for
    every forward pass once the layer has demoted some, attended beside the heap's slots and masked by position (so
    recalled tokens earn no heap score). ``index`` is the layer's place in the model."""

    demotion: Demotion | None = None
    index: int = 0

    def read(self, span: int, static: bool, query: torch.Tensor, decoding: bool) -> tuple[Slots, bool]:
        slots, in_order = super().read(span, static, query, decoding)
        assert self.demotion is not None
        recalled = self.demotion.recall(self.index, query, decoding)
        if recalled is None:
            return slots, in_order
        return (
            torch.cat([slots[0], recalled[0]], dim=2),
            torch.cat([slots[1], recalled[1]], dim=2),
            torch.cat([slots[2], recalled[2]], dim=2),
        ), False

    def before_free(self, victims: torch.Tensor) -> None:
        if self.sliding_window is not None:  # outside a window no query sees them again
            return
        assert self.demotion is not None
        keys, values, positions = self.slots(self.capacity)
        index = victims.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        self.demotion.demote(self.index, keys.gather(2, index), values.gather(2, index), positions.gather(2, victims))

    def capturable(self) -> bool:
        """A recall's pages are chosen and copied from the host at every step."""
        return False


def physical_memory() -> int | None:
    """This machine's physical memory in bytes, where the system says it."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
