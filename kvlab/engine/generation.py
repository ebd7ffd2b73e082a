"""The generation loop: read a context into the KV heap, let the policy evict, decode greedily.

One :class:`Generation` is one run of one policy over a batch of same-length prompts. Its steps are public and
short: :meth:`~Generation.read` (a context in chunks, evicting after each in streaming mode),
:meth:`~Generation.compress` (prefill mode's one eviction), :meth:`~Generation.decode` (tokens one at a time, in static
steps where they apply), and :meth:`~Generation.evict` (every layer cut back to its budget). :meth:`~Generation.events`
runs them in order and yields an :class:`~kvlab.engine.events.Event` after every step, carrying what the dashboard draws
and the seconds the engine took to produce it (the device synchronised, the consumer's time between events not counted);
:meth:`~Generation.result` gives one :class:`~kvlab.engine.events.GenerationResult` at the end, which the command
line, ``eval``, sweeps and the live page all store the same way. :func:`generate` drains the events.

Modes (:mod:`kvlab.modes`): ``prefill`` reads the context, then compresses once to the budget, and decoding appends
without evicting; ``streaming`` holds the budget the whole time, cutting every layer back after every chunk and
every decoded token. The run is planned before the first token (:mod:`kvlab.engine.plan`), so the heap
(:mod:`kvlab.cache.heap`) allocates once and writes in place; the cache spec decides how the heap stores what the
policy keeps. Survivors keep their original RoPE positions and every new token gets its true position: the heap's
position state (:mod:`kvlab.cache.positions`) is the one route positions take to the heap and the attention masks.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch

from kvlab.attention.backends import FLEX
from kvlab.attention.context import ForwardContext, Observer, forward_context
from kvlab.attention.flex import flex_compiles
from kvlab.attention.function import finish_pass, install_attention
from kvlab.attention.kernels import sdpa_backends
from kvlab.attention.observe import window_probabilities
from kvlab.attention.stats import StatsAccumulator, StatsRequest
from kvlab.cache.cake import cake_preference
from kvlab.cache.heap import KVHeap
from kvlab.cache.layer import HeapLayer
from kvlab.cache.ranking import eviction_count
from kvlab.cache.scopes import global_budgets, local_budgets
from kvlab.cache.sparse import ReadCount
from kvlab.engine.decoding import EagerSteps, decode
from kvlab.engine.events import Event, GenerationResult
from kvlab.engine.eviction import compress_layer, evict_layers, eviction_keys
from kvlab.engine.plan import NO_BUDGET, plan_run, spread
from kvlab.engine.prefilled import Prefilled
from kvlab.engine.reconstruction import reconstruct
from kvlab.engine.spec import RunSpec
from kvlab.engine.static import StaticSteps
from kvlab.engine.stopping import StopTokens, eos_token_ids
from kvlab.errors import KvlabError, shown_name
from kvlab.models.compiled import CHUNK, EAGER, STEP, LayerForward, compile_layers, layer_stance
from kvlab.models.loading import LoadedModel, device_name
from kvlab.models.rope import layer_ropes
from kvlab.modes import PREFILL, STREAMING
from kvlab.policies.base import LayerView, Policy
from kvlab.policies.full import Full
from kvlab.policies.variants import Variant, as_variant


class Generation:
    """One generation of one policy over a batch of same-length token sequences.

    ``suffix_ids`` are read after the context and, in ``prefill`` mode, after compression (a question asked of a
    compressed context); in ``streaming`` mode they are read in chunks like the context. ``prefilled`` continues
    from a context already read by :func:`prefill_once` (``prefill`` mode only) instead of ``input_ids``; the heap
    also remembers what the variants in ``observe_for`` need, for forks that they will compress.

    ``forced_ids`` (``(batch, max_new_tokens)``) are fed as the decoded tokens instead of the greedy choice: teacher
    forcing, a known text read one token at a time as if it had been generated, the cache evicting as decoding
    does, each decode event carrying the logits the step computed. Stop tokens do not end them, and the steps run
    eagerly (:mod:`kvlab.runs.quality` scores a text this way).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        spec: RunSpec,
        input_ids: torch.Tensor | None = None,
        suffix_ids: torch.Tensor | None = None,
        prefilled: Prefilled | None = None,
        observe_for: Sequence[Variant] = (),
        forced_ids: torch.Tensor | None = None,
    ) -> None:
        input_ids = _checked_inputs(spec, input_ids, suffix_ids, prefilled, forced_ids)
        self.loaded = loaded
        self.spec = spec
        install_attention(loaded.model)
        self.input_ids = input_ids.to(loaded.device)
        self.suffix_ids = suffix_ids.to(loaded.device) if suffix_ids is not None and suffix_ids.shape[1] else None
        self.context_tokens = int(input_ids.shape[1])
        suffix_tokens = 0 if self.suffix_ids is None else int(self.suffix_ids.shape[1])
        loaded.limits.check(self.context_tokens + suffix_tokens, spec.max_new_tokens, shown_name(loaded.name))
        self.plan = plan_run(spec, loaded, self.context_tokens, suffix_tokens, observe_for)
        #: Each layer's budget (the plan's, until CAKE's or the global scope's are decided at the compression).
        self.layer_budgets = list(self.plan.layer_budgets)
        #: Each layer's entries (tokens over its KV heads) where the global scope pools the heads, decided at the
        #: compression with the budgets (:func:`kvlab.cache.scopes.global_budgets`); else ``None``.
        self.layer_entries: list[int] | None = None
        #: The model's rotary embedding (for policies that model future queries), found once per generation.
        self.rope = layer_ropes(loaded.model)
        #: The backend static decode steps attend with on this device (:mod:`kvlab.attention.backends`).
        self.attention = spec.attention_on(loaded.device)
        chunk = spec.chunk_size(self.context_tokens)
        #: The prefill chunk whose passes run the layers compiled (:data:`~kvlab.models.compiled.CHUNK`): the run's
        #: chunk where the ``flex`` backend reads the context in several, else 0 (none).
        self.fused_chunk = chunk if self.attention == FLEX and self.context_tokens >= 2 * chunk else 0
        self.cache = self._heap(prefilled)
        #: The run's random draws (noise floor, random eviction), one seeded generator per device a layer runs on.
        self.generators = {device: torch.Generator(device=device).manual_seed(spec.seed) for device in loaded.devices}
        #: The K/V bytes attention reads while decoding (:class:`kvlab.cache.sparse.ReadCount`).
        self.reads = ReadCount(loaded.device)
        self.peak_kv_bytes = 0 if prefilled is None else prefilled.peak_kv_bytes
        self.peak_kv_reserved_bytes = 0 if prefilled is None else prefilled.peak_kv_reserved_bytes
        self.peak_gpu_bytes_per_device = {} if prefilled is None else dict(prefilled.peak_gpu_bytes_per_device)
        self.prefill_seconds = 0.0 if prefilled is None else prefilled.seconds
        self.decode_seconds = 0.0
        self.reconstruction_seconds = 0.0
        self.scope_seconds = 0.0
        self.decode_graphs = 0
        self.step_seconds: list[float] = []
        self.tokens: list[list[int]] = [[] for _ in range(self.batch_size)]
        self.forced_ids = forced_ids.to(loaded.device) if forced_ids is not None else None
        self.stops = StopTokens(
            ()
            if forced_ids is not None
            else spec.stop_token_ids
            if spec.stop_token_ids is not None
            else eos_token_ids(loaded),
            self.batch_size,
        )
        #: Whether forks of this run's context will compress it (:func:`prefill_once`).
        self.forked = bool(observe_for)
        #: Whether prefill mode's one compression has run (sliding windows are cut after every pass from then on).
        self.compressed = False
        self._start_logits = None if prefilled is None else prefilled.logits
        self._logits_to_keep = "logits_to_keep" in inspect.signature(loaded.model.forward).parameters

    def _heap(self, prefilled: Prefilled | None) -> KVHeap:
        """The run's heap as its plan and cache spec say: new, or a fork of a context read once."""
        plan = self.plan
        heap = KVHeap.build(
            list(plan.capacities),
            self.spec.cache,
            observed=plan.observed,
            room=plan.room,
            keep_planned=self.spec.mode == STREAMING,
            rope=self.rope,
            evicting=plan.evicting,
        )
        return heap if prefilled is None else heap.share(prefilled.cache)

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def budget_tokens(self) -> int | None:
        """The budget in tokens per layer and KV head (``None``: nothing to evict)."""
        return self.plan.budget_tokens

    @property
    def peak_gpu_bytes(self) -> int | None:
        """The peak GPU allocation so far, summed over the GPUs the model runs on (``None`` on a CPU)."""
        return sum(self.peak_gpu_bytes_per_device.values()) if self.peak_gpu_bytes_per_device else None

    # --- the steps ---------------------------------------------------------------------------------------------

    def read(self, ids: torch.Tensor, first_step: int) -> Iterator[Event]:
        """Read tokens in chunks, evicting after each in streaming mode; each event carries its chunk's last
        logits."""
        chunk = self.spec.chunk_size(self.context_tokens)
        if self.fused_chunk:
            self.fuse_layers()
        for index, start in enumerate(range(0, ids.shape[1], chunk)):
            logits, stats = self.forward(ids[:, start : start + chunk])
            self.evict()
            yield self.event("prefill", first_step + index, stats=stats, logits=logits)

    def compress(self, step: int) -> Event:
        """Prefill mode's one eviction: cut every layer to its budget (the heap's room, planned for prefill mode,
        leaves space for the question and the tokens to generate), or freeze what every layer keeps, after the
        passes the policy and the cache spec need first (KVzip's reconstruction; CAKE's and the global scope's
        layer budgets)."""
        policy = self.spec.policy
        if self.plan.rebudget == "prompt":
            self.allocate_by_prompt()
        if policy.reconstructs() and (self.plan.tiered or any(self.eviction_counts(to_budget=True))):
            self.reconstruct()
        if self.plan.rebudget == "global" and any(self.eviction_counts(to_budget=True)):
            self.allocate_globally()
        for view in self.layer_views():
            compress_layer(self.cache, policy, view)
        self.cache.stop_observing()
        self.compressed = True
        return self.event("compress", step)

    def decode(self, logits: torch.Tensor, step: int) -> Iterator[Event]:
        """Greedy decoding (or the forced tokens) from the prompt's last ``logits``: in static steps where they
        apply (:mod:`kvlab.engine.static`), else one eager forward pass per token (:mod:`kvlab.engine.decoding`)."""
        return decode(self, logits, step, StaticSteps.for_loop(self) or EagerSteps(self))

    def evict(self, next_position: int | torch.Tensor | None = None) -> None:
        """After a forward pass: in streaming mode, cut every layer back to its budget; in prefill mode, where the
        budget is met once at the compression, drop only what sliding windows can no longer see, so that a layer
        with a window never holds more than the full cache's ``window - 1`` tokens (as transformers' own cache)."""
        if not self.evicts():
            return
        streaming = self.spec.mode == STREAMING
        policy = self.spec.policy if streaming else _WINDOWS
        evict_layers(self.cache, policy, self.layer_views(next_position, to_budget=streaming))

    def evicts(self) -> bool:
        """Whether :meth:`evict` can free anything: in streaming mode where the plan prunes; in prefill mode where
        the model has sliding-window layers, except before a compression, its own or a fork's (which cuts the
        windows itself, and whose passes, KVzip's reconstruction, read the context as it was read)."""
        if self.spec.mode == STREAMING:
            return self.plan.prunes
        return self.plan.windows and (self.compressed or not (self.compresses() or self.forked))

    def compresses(self) -> bool:
        """Whether the run compresses once after reading its context (prefill mode): where it evicts to a budget,
        freezes what it keeps, or an ablation removes tokens."""
        return self.spec.mode == PREFILL and bool(
            self.plan.evicting or self.cache.freezes or self.spec.policy.removes()
        )

    def evicts_after(self, index: int) -> bool:
        """Whether the ``index``-th decode step evicts: in streaming mode once every ``compression_interval``
        tokens; in prefill mode after every step on a model with sliding-window layers (:meth:`evict`)."""
        if self.spec.mode == STREAMING:
            return self.plan.prunes and (index + 1) % self.spec.compression_interval == 0
        return self.evicts()

    # --- what the steps share ----------------------------------------------------------------------------------

    def forward(self, ids: torch.Tensor, decoding: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """Run the model over ``ids`` appended at their true positions (a decode step's token when ``decoding``),
        note the peak bytes and a decode step's reads; the last position's logits and the requested statistics."""
        start = self.cache.seen_tokens
        n_new = int(ids.shape[1])
        positions = torch.arange(start, start + n_new, device=self.loaded.device)
        stats = None
        if self.spec.stats is not None:
            request = StatsRequest(self.spec.stats.n_sink, self.spec.stats.n_bins, self.plan.span)
            stats = StatsAccumulator(request, self.loaded.arch.num_layers)
        logits = self.model_forward(ids, positions, start + n_new - 1, stats, decoding=decoding)
        self.step_done(decoding)
        return logits, (stats.finish(n_new) if stats is not None else None)

    def model_forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        last_position: int,
        stats: StatsAccumulator | None = None,
        cache: KVHeap | None = None,
        observe: Observer | None = None,
        decoding: bool = False,
    ) -> torch.Tensor:
        """The model over ``ids`` at ``positions`` (a device tensor; ``last_position`` its last value where the host
        knows it, else -1), writing into the heap (or into ``cache``, a fork of it), its attention handed to
        ``observe`` when given; the last logits. A ``decoding`` step reads through the sparse reader, if any."""
        heap = self.cache if cache is None else cache
        context = ForwardContext(heap, stats, observe, decoding=decoding, attention=self.attention)
        if decoding and self.plan.reader is not None:
            context.reader, context.reads = self.plan.reader, self.reads
        kwargs: dict[str, Any] = {
            self.loaded.cache_kwarg: heap,
            "position_ids": positions.unsqueeze(0).expand(ids.shape[0], -1),
            "use_cache": True,
        }
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        heap.begin_pass(positions, last_position)
        stance = layer_stance(self.loaded.model, self.layer_forward(int(ids.shape[1]), decoding, heap))
        with forward_context(context), sdpa_backends(self.loaded.device), stance:
            output = self.loaded.model(input_ids=ids, **kwargs)
        finish_pass(context)
        heap.end_pass(int(ids.shape[1]))
        return output.logits[:, -1, :].to(self.loaded.device)  # from the last layer's device, where split

    def layer_forward(self, tokens: int, decoding: bool, heap: KVHeap) -> LayerForward:
        """Which of the layers' forwards a pass of ``tokens`` runs (:mod:`kvlab.models.compiled`): compiled for the
        ``flex`` backend's static decode steps and its full prefill chunks, eager for every other pass."""
        if decoding:
            return STEP if heap.static and self.attention == FLEX else EAGER
        return CHUNK if tokens == self.fused_chunk else EAGER

    def step_done(self, decoding: bool) -> None:
        """After a forward pass, before eviction: note the bytes held if they are the most so far, and count a decode
        step's reads (every layer read in full, the bytes it holds now; a sparse reader's layers add what they
        selected on the device as they read)."""
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.cache.kv_bytes())
        self.peak_kv_reserved_bytes = max(self.peak_kv_reserved_bytes, self.cache.reserved_bytes())
        if decoding:
            reader = self.plan.reader
            layers = enumerate(self.cache.layers)
            self.reads.add_step(
                sum(layer.live_bytes() for i, layer in layers if reader is None or not reader.reads_sparsely(i))
            )

    def graph_captured(self) -> None:
        """Count one more decode step captured in a CUDA graph."""
        self.decode_graphs += 1

    def fuse_layers(self) -> None:
        """Before the first full prefill chunk or captured step: under the ``flex`` backend where it compiles (CUDA
        with Triton), compile the model's layers, so that those passes run them fused
        (:mod:`kvlab.models.compiled`)."""
        if self.attention == FLEX and flex_compiles():
            compile_layers(self.loaded.model)

    def note_peak(self, kv_bytes: int, reserved_bytes: int) -> None:
        """Note bytes held beside the heap's own (a reconstruction's fork) if they are the most so far."""
        self.peak_kv_bytes = max(self.peak_kv_bytes, kv_bytes)
        self.peak_kv_reserved_bytes = max(self.peak_kv_reserved_bytes, reserved_bytes)

    def eviction_counts(self, to_budget: bool | None = None) -> list[int]:
        """How many tokens each layer gives up at the next eviction (host counts only: the rule
        :func:`kvlab.engine.eviction.evict_layer` follows): :meth:`evict`'s, or with ``to_budget`` the
        compression's."""
        if to_budget is None:
            if not self.evicts():
                return [0] * len(self.layer_budgets)
            to_budget = self.spec.mode == STREAMING
        elif not self.plan.prunes:
            return [0] * len(self.layer_budgets)
        return [
            eviction_count(layer, budget, uniform)
            for layer, (budget, uniform) in zip(self.cache.layers, self.budgets(to_budget))
        ]

    def budgets(self, to_budget: bool = True) -> list[tuple[int, int]]:
        """Each layer's budget and the uniform budget for an eviction now: the run's, at most the tokens seen after
        those an ablation removes (:meth:`~kvlab.policies.base.Policy.removes`); without ``to_budget`` none (only
        sliding windows then cut)."""
        if not to_budget:
            return [(NO_BUDGET, NO_BUDGET)] * len(self.layer_budgets)
        uniform = self.plan.held_tokens or NO_BUDGET
        removed = self.spec.policy.removes()
        most = max(self.cache.seen_tokens - removed, 0) if removed else NO_BUDGET
        return [(min(budget, most), min(uniform, most)) for budget in self.layer_budgets]

    def layer_views(self, next_position: int | torch.Tensor | None = None, to_budget: bool = True) -> list[LayerView]:
        """What the policy sees of each layer for an eviction now, with the layer's budget (none without
        ``to_budget``)."""
        position = self.cache.seen_tokens if next_position is None else next_position
        return [
            LayerView(
                layer_idx,
                len(self.layer_budgets),
                layer,
                budget,
                uniform,
                position,
                self.generators[self.loaded.layer_devices[layer_idx]],
                layer.span(self.cache.static),
                None if self.rope is None else self.rope[layer_idx],
                self.cache,
                None if self.layer_entries is None or not to_budget else self.layer_entries[layer_idx],
            )
            for layer_idx, (layer, (budget, uniform)) in enumerate(zip(self.cache.layers, self.budgets(to_budget)))
        ]

    def event(self, kind: Literal["prefill", "compress", "decode"], step: int, **extra: Any) -> Event:
        """An event describing the heap as it is now."""
        return Event(
            kind=kind,
            step=step,
            seen_tokens=self.cache.seen_tokens,
            kept_per_layer=self.cache.kept_per_layer(),
            kv_bytes=self.cache.kv_bytes(),
            kv_bytes_full=self.full_cache_bytes(),
            kv_reserved_bytes=self.cache.reserved_bytes(),
            dead_share=self.cache.dead_share(),
            compactions=self.cache.compactions,
            positions=[layer.held_positions() for layer in self.cache.layers if layer.positions is not None],
            demoted_bytes=self.cache.tier_bytes(),
            **extra,
        )

    def full_cache_bytes(self) -> int:
        """What a full (never evicted) cache of the same dtype and shapes would hold after the tokens seen so far;
        sliding-window layers counted at the ``window - 1`` tokens transformers' own cache keeps there."""
        arch = self.loaded.arch
        seen = self.cache.seen_tokens
        per_token = 2 * self.batch_size * arch.num_kv_heads * arch.head_dim * self.loaded.kv_bytes_per_element
        total = 0
        for layer_idx, layer in enumerate(self.cache.layers):
            window = (
                layer.sliding_window
                if layer.sliding_window is not None
                else (arch.sliding_window if arch.is_sliding(layer_idx) else None)
            )
            total += per_token * (min(seen, window - 1) if window is not None else seen)
        return total

    # --- the passes some runs need before their compression ----------------------------------------------------

    def reconstruct(self) -> None:
        """KVzip's scores: the model reconstructs the context on a fork of the heap
        (:mod:`kvlab.engine.reconstruction`), timed on its own (the device synchronised); its seconds are also part of
        the compression event's, so of the prefill's."""
        with self._timed() as clock:
            tokenizer, forward = self.loaded.tokenizer, self.model_forward
            reconstruct(self.cache, self.input_ids, tokenizer, self.spec.policy, forward, self.note_peak)
        self.reconstruction_seconds += clock.seconds

    def allocate_globally(self) -> None:
        """The global eviction scope's layer budgets (:func:`kvlab.cache.scopes.global_budgets`): every layer's
        ranking keys gathered on the input device under one threshold, timed on its own (the devices synchronised;
        the decision reads its counts on the host); its seconds are also part of the compression event's."""
        held = self.plan.held_tokens
        assert held is not None
        with self._timed() as clock:
            keys = eviction_keys(self.spec.policy, self.layer_views(), self.cache)
            minimum = self.spec.policy.min_budget()
            self.layer_budgets, self.layer_entries = global_budgets(
                keys, held, minimum, self.context_tokens, self.loaded.device, self.plan.pools_heads
            )
        self.scope_seconds += clock.seconds

    def allocate_by_prompt(self) -> None:
        """CAKE's layer budgets for this prompt: each layer's preference from its observation window's attention over
        the tokens before the window, measured once the whole context is read (the whole batch shares them); on a
        model split over devices, each placement group splits its own total by its own layers' preferences."""
        budget = self.plan.budget_tokens
        assert budget is not None
        preferences = [_cake_preference(layer, layer.span(self.cache.static)) for layer in self.cache.layers]
        policy, options = self.spec.policy, self.spec.cache.options
        self.layer_budgets = local_budgets(
            lambda layers, own: spread(policy, options, budget, layers, self.context_tokens, own),
            self.loaded.layer_groups,
            preferences,
        )

    @contextlib.contextmanager
    def _timed(self) -> Iterator[_Seconds]:
        """Time a pass with every device the model runs on synchronised before and after."""
        clock = _Seconds()
        _synchronize(*self.loaded.devices)
        started = time.perf_counter()
        yield clock
        _synchronize(*self.loaded.devices)
        clock.seconds = time.perf_counter() - started

    # --- running it --------------------------------------------------------------------------------------------

    def events(self) -> Iterator[Event]:
        """Run the generation, yielding an event per prefill chunk, compression and decoded token, each with the
        seconds it took (the device synchronised; the consumer's time between events is not counted). A GPU that
        runs out of memory becomes one sentence, and the memory is handed back for the next run. Every device the
        model runs on is synchronised, and each GPU's peak allocation read."""
        devices = self.loaded.devices
        gpus = [device for device in devices if device.type == "cuda"]
        for gpu in gpus:
            torch.cuda.reset_peak_memory_stats(gpu)
        with torch.inference_mode(), _out_of_memory_as_error(self.cache):
            steps = self._steps()
            try:
                while True:
                    started = time.perf_counter()
                    event = next(steps, None)
                    if event is None:
                        return
                    _synchronize(*devices)
                    event.seconds = time.perf_counter() - started
                    self._account(event)
                    yield event
            finally:  # read once, also when the consumer stops early (reading it builds the allocator's statistics)
                for gpu in gpus:
                    name, peak = device_name(gpu), torch.cuda.max_memory_allocated(gpu)
                    self.peak_gpu_bytes_per_device[name] = max(self.peak_gpu_bytes_per_device.get(name, 0), peak)
                self.cache.close()  # the offload file goes with the run; the counts stay

    def _account(self, event: Event) -> None:
        """Add an event to the run's seconds and tokens."""
        if event.kind == "decode":
            self.decode_seconds += event.seconds
            self.step_seconds.append(event.seconds)
            for sequence, token in zip(self.tokens, event.token_ids or []):
                sequence.append(token)
        else:
            self.prefill_seconds += event.seconds

    def _steps(self) -> Iterator[Event]:
        step = 0
        logits = self._start_logits
        if logits is None:
            for event in self.read(self.input_ids, step):
                step, logits = step + 1, event.logits
                yield event
        if self.compresses():
            yield self.compress(step)
            step += 1
        if self.suffix_ids is not None:
            for event in self.read(self.suffix_ids, step):
                step, logits = step + 1, event.logits
                yield event
        assert logits is not None
        if self.spec.max_new_tokens:
            yield from self.decode(logits, step)

    def result(self) -> GenerationResult:
        """What the generation produced and held, once :meth:`events` is exhausted."""
        tokens = [self.stops.trim(sequence) for sequence in self.tokens]
        tokenizer = self.loaded.tokenizer
        heap = self.cache
        return GenerationResult(
            tokens=tokens,
            texts=[tokenizer.decode(t, skip_special_tokens=True) if tokenizer is not None else "" for t in tokens],
            context_tokens=self.context_tokens,
            budget_tokens=self.plan.budget_tokens,
            kept_per_layer=heap.kept_per_layer(),
            kv_bytes=heap.kv_bytes(),
            kv_bytes_full=self.full_cache_bytes(),
            peak_kv_bytes=self.peak_kv_bytes,
            kv_reserved_bytes=heap.reserved_bytes(),
            peak_kv_reserved_bytes=self.peak_kv_reserved_bytes,
            dead_share=heap.dead_share(),
            compactions=heap.compactions,
            compaction_seconds=heap.compaction_seconds(),
            aux_bytes=heap.aux_bytes(),
            prefill_seconds=self.prefill_seconds,
            decode_seconds=self.decode_seconds,
            peak_gpu_bytes=self.peak_gpu_bytes,
            device="+".join(device_name(device) for device in self.loaded.devices),
            dtype=self.loaded.dtype_name,
            layout=self.spec.cache.layout,
            decode_graphs=self.decode_graphs,
            ranked_slots=heap.ranked_slots,
            ranking_seconds=heap.ranking_seconds(),
            tie_share=heap.tie_share(),
            read_bytes_per_token=self.reads.per_step(),
            reconstruction_seconds=self.reconstruction_seconds,
            kv_bytes_per_device=heap.per_device(HeapLayer.live_bytes),
            kv_reserved_bytes_per_device=heap.per_device(HeapLayer.reserved_bytes),
            peak_gpu_bytes_per_device=self.peak_gpu_bytes_per_device or None,
            scope_seconds=self.scope_seconds,
            demotion=heap.demotion_report(self.reads.steps),
            token_seconds=self.step_seconds[:-1],  # the last decode event runs no step
        )


def generate(
    loaded: LoadedModel,
    input_ids: torch.Tensor | None,
    spec: RunSpec,
    suffix_ids: torch.Tensor | None = None,
    prefilled: Prefilled | None = None,
) -> GenerationResult:
    """Run one generation to the end and report what it produced and held (:meth:`Generation.result`)."""
    generation = Generation(loaded, spec, input_ids, suffix_ids, prefilled)
    for _ in generation.events():
        pass
    return generation.result()


def prefill_once(
    loaded: LoadedModel, input_ids: torch.Tensor, variants: Sequence[Variant | Policy], chunk: int | None = None
) -> Prefilled:
    """Read ``input_ids`` once for all ``variants`` (policies with their cache options, or policies alone; see
    :class:`~kvlab.engine.prefilled.Prefilled`)."""
    observed = [as_variant(variant) for variant in variants]
    reader = Generation(loaded, RunSpec(Full(), chunk=chunk, max_new_tokens=0), input_ids, observe_for=observed)
    last = None
    for last in reader.events():
        pass
    assert last is not None and last.logits is not None
    return Prefilled(
        reader.input_ids,
        reader.cache,
        last.logits,
        reader.peak_kv_bytes,
        reader.peak_kv_reserved_bytes,
        reader.prefill_seconds,
        reader.peak_gpu_bytes_per_device,
    )


#: What prefill mode's :meth:`Generation.evict` ranks by: the full cache's rule, which drops only what sliding windows
#: can no longer see (the run's policy is not asked, so it draws no noise and scores nothing between compressions).
_WINDOWS = Full()


class _Seconds:
    """The seconds a timed pass took, set when it ends."""

    seconds: float = 0.0


def _cake_preference(layer: HeapLayer, span: int) -> float:
    """CAKE's preference of one layer: its observation window's attention over the tokens before the window."""
    assert layer.recent_query_positions is not None
    first_query = int(layer.recent_query_positions.min())  # a static step's window is not in order
    positions = layer.slots(span)[2]
    before_window = (positions >= 0) & (positions < first_query)
    return cake_preference(window_probabilities(layer, span), keys=before_window)


def _checked_inputs(
    spec: RunSpec,
    input_ids: torch.Tensor | None,
    suffix_ids: torch.Tensor | None,
    prefilled: Prefilled | None,
    forced_ids: torch.Tensor | None,
) -> torch.Tensor:
    """The prompt's token ids (a context read once gives its own), each input checked in one sentence."""
    if prefilled is not None:
        if spec.mode != PREFILL:
            raise KvlabError("A context read once for several policies can only be compressed in prefill mode.")
        input_ids = prefilled.input_ids
    if input_ids is None:
        raise KvlabError("Give the prompt's token ids, or a context already read.")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise KvlabError("The prompt is empty; give at least one token of context.")
    if suffix_ids is not None and (suffix_ids.dim() != 2 or suffix_ids.shape[0] != input_ids.shape[0]):
        raise KvlabError("The question tokens must have one row per prompt.")
    if forced_ids is not None and tuple(forced_ids.shape) != (input_ids.shape[0], spec.max_new_tokens):
        raise KvlabError("The forced tokens must have one row per prompt and max_new_tokens tokens in each.")
    return input_ids


@contextlib.contextmanager
def _out_of_memory_as_error(cache: KVHeap) -> Iterator[None]:
    """Turn a GPU out-of-memory error into one sentence, after releasing the allocator's cached blocks."""
    try:
        yield
    except torch.OutOfMemoryError:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        raise KvlabError(
            f"The GPU ran out of memory after {cache.seen_tokens} tokens; lower the context, batch or budget, or "
            "use streaming mode."
        ) from None


def _synchronize(*devices: torch.device) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
