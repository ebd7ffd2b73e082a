"""Live run: pick a task, a policy and a budget, and watch the cache being evicted while the model reads and answers;
or replay stored runs, one or two side by side, with a scrubber and no model."""

from __future__ import annotations

from functools import partial

import streamlit as st

from kvlab.budget import Budget
from kvlab.cache.layouts import DEFAULT_COMPACT_AT, DEFAULT_LAYOUT, LAYOUT_HELP, LAYOUTS
from kvlab.dashboard import live_figures as figures
from kvlab.dashboard.allocation_figures import ALLOCATION_GUIDE, allocation_figure
from kvlab.dashboard.chart_view import how_to_read, show_chart
from kvlab.dashboard.inputs import (
    CACHE_OPTIONS_TITLE,
    cache_option_fields,
    longest_context,
    policy_fields,
    policy_summary,
    read_upload,
)
from kvlab.dashboard.live_view import draw_charts, param_widget, show_output, stacked_slots, wide_slots
from kvlab.dashboard.playback import PLAY_STEP_S, play_button, scrubber
from kvlab.dashboard.session import (
    current_model,
    current_user,
    open_page_store,
    stored_replay,
    waiting_notice,
)
from kvlab.dashboard.text import plain
from kvlab.engine.plan import spread
from kvlab.errors import KvlabError
from kvlab.models.loading import LoadedModel
from kvlab.models.profiles import load_profile
from kvlab.modes import PREFILL, STREAMING, modes_help
from kvlab.policies import POLICIES, Variant
from kvlab.runs.device_queue import DEVICE_QUEUE
from kvlab.runs.live import LiveRun, LiveSettings, NeedleTask, RedrawClock, TextTask, build_prompt, prompt_tokens
from kvlab.runs.live_store import LiveResult, file_live_run
from kvlab.runs.replay import EXAMPLES_DB, replay_choices, replay_stores
from kvlab.store import default_db_path
from kvlab.tasks.facts import TEMPLATES
from kvlab.tasks.items import has_chat_template
from kvlab.units import format_bytes

RESULT_KEY = "live_result"
OPTIONS_NOTE = (
    "`layer_allocation` spreads the same total budget over layers (preset, entropy, cake) and shows each layer's "
    "share here; `head_allocation` adakv lets a layer's heads share it. `hot` below 1 holds the rest of the kept "
    "tokens at `key_bits` and `value_bits`. `noise` adds seeded noise to the scores before ranking. Prefill mode "
    "only: `hot` below 1, adakv and cake. `cpu_tier_mib` and `disk_tier_mib` above 0 demote evicted tokens to "
    "CPU memory and a file instead of deleting them, in pages of `page_tokens`, and every pass recalls the "
    "`recall_pages` pages its queries score highest; the charts then show the memory by tier."
)
BROWSER_INT = (1 << 53) - 1  # the largest whole number a browser's number field holds exactly
REDRAW_EVERY_DECODED = 4
REDRAW_INTERVAL_S = 1.0

st.title("Live run")
source = st.radio(
    "Show",
    ["Run a model", "Replay stored runs"],
    horizontal=True,
    key="live_source",
    persist_state="session",
    label_visibility="collapsed",
)


def replay_page() -> None:
    """Stored runs replayed without a model: one, or two side by side on one scrubber."""
    st.caption(
        "A stored live run is kept with everything its charts drew, event by event. Pick one run, or two (for "
        "example H2O and SnapKV on the same prompt), and move the scrubber: both runs show the moment they had "
        "read or generated that many tokens."
    )
    stores = replay_stores(default_db_path(), EXAMPLES_DB)
    if not stores:
        st.info("No stored runs to replay yet: run a live run first (it is stored with its replay).")
        return
    where = st.radio("From", list(stores), horizontal=True, key="live_replay_store", persist_state="session")
    with open_page_store(stores[where]) as store:
        listed = store.replays()
    choices = replay_choices(listed)
    if not choices:
        st.info("This store holds no replays yet: a live run stores one when it is scored (it has an answer).")
        return
    picked = st.multiselect(
        "Runs (one, or two side by side)",
        list(choices),
        default=list(choices)[:1],
        max_selections=2,
        format_func=lambda key: choices[key],
        key=f"live_replay_runs-{where}",
        persist_state="session",
    )
    if not picked:
        st.info("Pick a run to replay.")
        return
    replays = [stored_replay(stores[where], run_id, trial_key) for run_id, trial_key in picked]
    positions = sorted(set().union(*(replay.positions for replay in replays)))
    replay_key = f"live_replay-{where}-{picked}"
    playing = play_button(st.container(), positions, replay_key)

    @st.fragment(run_every=PLAY_STEP_S if playing else None)
    def replayed() -> None:
        """The runs at the scrubber's step, side by side; while playing, redrawn one step further at each tick."""
        scrub, view = st.columns([4, 1])
        position = scrubber(
            scrub,
            positions,
            replay_key,
            "Tokens read and generated",
            "Each step is an event of one of the runs: a prefill chunk, a compression or a generated token.",
        )
        layers = max(replay.trace.num_layers for replay in replays)
        layer = view.selectbox(
            "3D view",
            [None, *range(layers)],
            format_func=figures.layer_name,
            key="live_replay_3d",
            persist_state="session",
        )
        if len(replays) == 2 and replays[0].about.get("task") != replays[1].about.get("task"):
            st.warning("These two runs read different prompts; they are shown side by side at the same position.")
        columns = st.columns(len(replays))
        for index, (column, replay) in enumerate(zip(columns, replays)):
            trace, text = replay.at(position)
            column.markdown(f"**{plain(replay.headline)}**")
            column.caption(plain(replay.where_from))
            column.caption(trace.status())
            show_output(column, text or "…")
            demoted = replay.trace.demotes
            slots = (
                wide_slots(f"replay{index}", demoted)
                if len(replays) == 1
                else stacked_slots(column, f"replay{index}", demoted)
            )
            shown = layer if layer is None or layer < trace.num_layers else None
            draw_charts(slots, trace, shown, "replay", replay.demotion)

    replayed()


def layer_budgets(
    variant: Variant, allocation: str, budget: Budget | None, task: NeedleTask | TextTask | None, loaded: LoadedModel
) -> None:
    """The budget each layer keeps under the chosen layer allocation: drawn against the others over the model's
    attention profile where it has one, else listed."""
    length = None if task is None else prompt_tokens(loaded, task)
    if budget is None or length is None:
        st.caption("Each layer's budget is shown once there is a budget and a prompt to read.")
        return
    tokens = budget.resolve(length)
    try:
        profile = load_profile(loaded.weights_hash) if loaded.weights_hash is not None else None
    except KvlabError as error:
        st.caption(plain(str(error)))
        profile = None
    if profile is not None and profile.num_layers == loaded.arch.num_layers:
        how_to_read(st.container(), ALLOCATION_GUIDE, key="live-allocation-guide")
        figure = allocation_figure(profile, tokens, variant.policy.min_budget(), length, chosen=allocation)
        show_chart(st.container(), figure, key="live-allocation", filename="kvlab-layer-budgets")
    elif allocation == "cake":
        st.caption(
            "CAKE sets each layer's budget from the prompt's own attention at the compression; the finished run "
            "lists what each layer kept."
        )
    else:
        shares = spread(variant.policy, variant.options, tokens, loaded.arch.num_layers, length, None)
        st.caption(f"Tokens per layer under {allocation} at {tokens:,} per layer: {', '.join(map(str, shares))}.")


if source == "Replay stored runs":
    replay_page()
    st.stop()

st.caption(
    "The model reads the prompt chunk by chunk under the chosen policy and budget, then answers. Every chart "
    "is redrawn after each prefill chunk and every few generated tokens. Changing a setting while a run is "
    "in progress stops it."
)
loaded = current_model()
if loaded is None:
    st.warning("Pick a model that loads in the sidebar to run anything here.")

task_column, policy_column, run_column = st.columns([1.3, 1.2, 1])
with task_column:
    kind = st.radio(
        "Task", ["Needle in a haystack", "Your text"], horizontal=True, key="live_task", persist_state="session"
    )
    task: NeedleTask | TextTask | None
    if kind == "Needle in a haystack":
        longest = longest_context(loaded)
        length = st.number_input(
            "Context length (tokens)",
            min_value=64,
            max_value=longest,
            value=min(2048, longest),
            step=256,
            key="live_length",
            persist_state="session",
        )
        depth = st.slider(
            "Needle depth",
            0.0,
            1.0,
            0.5,
            0.05,
            help="Where the fact sits: 0 is the start of the text.",
            key="live_depth",
            persist_state="session",
        )
        template = st.selectbox(
            "Fact",
            list(TEMPLATES),
            help="Templates marked held out never appeared in training.",
            format_func=lambda name: name + (" (held out)" if TEMPLATES[name].held_out else ""),
            key="live_template",
            persist_state="session",
        )
        seed = st.number_input(
            "Seed (key, value and haystack)",
            min_value=0,
            max_value=BROWSER_INT,
            value=0,
            step=1,
            key="live_seed",
            persist_state="session",
        )
        task = NeedleTask(int(length), float(depth), template, int(seed))
    else:
        upload = st.file_uploader("Upload a text file", type=["txt", "md", "rst", "py", "json", "csv", "log"])
        pasted = st.text_area(
            "…or paste a text", height=120, placeholder="A long document", key="live_text", persist_state="session"
        )
        question = st.text_input(
            "Question",
            help="Without one, the model just continues the text.",
            key="live_question",
            persist_state="session",
        )
        answer = st.text_input(
            "Expected answer",
            help="Needed to score the run; unscored runs are not stored.",
            key="live_answer",
            persist_state="session",
        )
        templated = loaded is not None and has_chat_template(loaded.tokenizer)
        chat = st.checkbox(
            "Wrap in the model's chat template",
            value=templated,
            disabled=not templated,
            help="On: the text (and question) are one user turn and the model answers in its own turn, as a chat "
            "model is trained to. Off: the model reads the text as it is."
            + ("" if templated else " This model has no chat template."),
            key=f"live_chat-{loaded.name if loaded else None}",  # one per model: its default follows the model
            persist_state="session",
        )
        task = TextTask(pasted, question, answer, chat)
        if upload is not None:
            try:
                task = TextTask(read_upload(upload.name, upload.getvalue()), question, answer, chat)
            except KvlabError as error:
                st.error(plain(str(error)))
                task = None

with policy_column:
    policy = st.selectbox(
        "Policy", list(POLICIES), index=list(POLICIES).index("h2o"), key="live_policy", persist_state="session"
    )
    st.caption(policy_summary(policy))
    params: dict[str, object] = {
        field.name: param_widget(st.container(), field, f"live_{policy}_{field.name}")
        for field in policy_fields(policy)
    }
    evicts = POLICIES[policy].evicts
    budget_kind = st.radio(
        "Budget",
        ["kept fraction", "tokens per layer"],
        horizontal=True,
        disabled=not evicts,
        help="Tokens each layer keeps per KV head, sinks and windows included; a fraction is of the prompt.",
        key="live_budget_kind",
        persist_state="session",
    )
    if budget_kind == "kept fraction":
        budget = Budget(
            keep=st.slider(
                "Kept fraction", 0.01, 1.0, 0.1, 0.01, disabled=not evicts, key="live_keep", persist_state="session"
            )
        )
    else:
        budget = Budget(
            tokens=int(
                st.number_input(
                    "Tokens per layer per KV head",
                    min_value=1,
                    value=256,
                    step=32,
                    disabled=not evicts,
                    key="live_tokens",
                    persist_state="session",
                )
            )
        )

with run_column:
    mode = st.radio(
        "Mode",
        [STREAMING, PREFILL],
        horizontal=True,
        help=modes_help((STREAMING, PREFILL)),
        key="live_mode",
        persist_state="session",
    )
    chunk = int(
        st.number_input(
            "Chunk (tokens per forward pass)",
            min_value=16,
            max_value=4096,
            value=256,
            step=64,
            key="live_chunk",
            persist_state="session",
        )
    )
    max_new = int(
        st.number_input(
            "Tokens to generate (at most)",
            min_value=1,
            max_value=256,
            value=24,
            key="live_new",
            persist_state="session",
        )
    )
    query_aware = st.checkbox(
        "Read the question before compressing",
        value=True,
        help="Off: prefill mode compresses the text before it sees the question.",
        key="live_query_aware",
        persist_state="session",
    )
    heap_layout = st.selectbox(
        "Heap layout",
        LAYOUTS,
        index=LAYOUTS.index(DEFAULT_LAYOUT),
        help=LAYOUT_HELP,
        key="live_layout",
        persist_state="session",
    )
    compact_at = st.slider(
        "Compact at dead share",
        0.05,
        1.0,
        DEFAULT_COMPACT_AT,
        0.05,
        disabled=heap_layout != "threshold",
        help="The threshold layout compacts a layer once this share of its slots in use is dead.",
        key="live_compact_at",
        persist_state="session",
    )
    layers = loaded.arch.num_layers if loaded else 0
    layer = st.selectbox(
        "3D view", [None, *range(layers)], format_func=figures.layer_name, key="live_3d", persist_state="session"
    )
    run_slot = st.empty()

options = cache_option_fields(policy)
if options:
    with st.expander(CACHE_OPTIONS_TITLE):
        option_widgets, allocation_view = st.columns([1, 1], gap="large")
        with option_widgets:
            for pair in range(0, len(options), 2):
                for column, field in zip(st.columns(2), options[pair : pair + 2]):
                    params[field.name] = param_widget(column, field, f"live_{policy}_{field.name}")
settings = LiveSettings(
    policy, params, budget if evicts else None, mode, chunk, max_new, query_aware, heap_layout, compact_at
)
checked: Variant | None = None
try:
    checked = settings.checked_variant(loaded)
except KvlabError as error:
    st.error(plain(str(error)))
if options:
    allocation = str(params["layer_allocation"])
    with allocation_view:
        if allocation == "uniform":
            st.caption(OPTIONS_NOTE)
        elif checked is not None and loaded is not None:
            layer_budgets(checked, allocation, budget if evicts else None, task, loaded)
run = run_slot.button(
    "Run", type="primary", disabled=loaded is None or task is None or checked is None, icon=":material/play_arrow:"
)

notice = st.empty()
status = st.empty()
output = st.empty()
slots = wide_slots("live", tiers=evicts and checked is not None and checked.options.demotes)
asked = (task, settings, loaded.name if loaded else None)

if run and loaded is not None and task is not None:
    st.session_state.pop(RESULT_KEY, None)
    try:
        prompt = build_prompt(loaded, task)
        live = LiveRun(loaded, prompt, settings)
        with live.on_device(DEVICE_QUEUE, waiting_notice(notice)) as events:
            notice.empty()
            redraws = RedrawClock(REDRAW_INTERVAL_S, REDRAW_EVERY_DECODED)
            for index, _ in enumerate(events):
                if redraws.due(live.trace):
                    status.caption(live.trace.status())
                    show_output(output, loaded.tokenizer.decode(live.trace.token_ids) or "…")
                    draw_charts(slots, live.trace, layer, str(index))
        outcome = live.outcome()
        filed = file_live_run(partial(open_page_store, write=True), live, outcome, current_user())
        st.session_state[RESULT_KEY] = LiveResult(live.trace, outcome, prompt, filed, asked)
    except KvlabError as error:
        notice.error(plain(str(error)))

stale: LiveResult | None = st.session_state.get(RESULT_KEY)
if stale is not None and stale.ran_with != asked:  # a setting changed since: its result no longer matches the page
    st.session_state.pop(RESULT_KEY)
    notice.info("The settings changed since the last run, so its result was cleared: press Run to run with them.")
result: LiveResult | None = st.session_state.get(RESULT_KEY)
if result is None:
    draw_charts(slots, None, layer, "idle")
else:
    draw_charts(slots, result.trace, layer, "final", result.outcome.result.demotion)
    outcome, prompt = result.outcome, result.prompt
    show_output(output, outcome.text or "(nothing generated)")
    answer = plain(repr(prompt.answer))
    if outcome.contains is None:
        status.info("Not scored and not stored: give an expected answer to score a run.")
    elif outcome.exact:
        status.success(f"Found: the answer {answer} is the first line of the output.")
    elif outcome.contains:
        status.warning(f"Found inside the output, but not as its first line: {answer}.")
    else:
        status.error(f"Not found: the expected answer was {answer}.")
    filed = result.filed
    if filed.problem is not None and filed.record is not None:
        st.error(plain(filed.problem) + " The result is kept on this page: download it to keep it.")
        st.download_button(
            "Download this run (CSV)",
            data=filed.record,
            file_name="kvlab-live-run.csv",
            mime="text/csv",
            on_click="ignore",
            icon=":material/download:",
        )
    memory = st.columns(4)
    memory[0].metric("Prompt tokens", f"{prompt.context_tokens:,}")
    memory[1].metric(
        "KV in use (measured)",
        format_bytes(outcome.result.kv_bytes),
        help="Bytes of the slots holding a token at the end.",
    )
    memory[2].metric(
        "KV reserved (measured)",
        format_bytes(outcome.result.kv_reserved_bytes),
        help="Bytes of the heap's tensors at the end: what the cache holds from the allocator.",
    )
    memory[3].metric("Full cache (computed)", format_bytes(outcome.result.kv_bytes_full))
    heap = st.columns(4)
    heap[0].metric(
        "Peak KV in use",
        format_bytes(outcome.result.peak_kv_bytes),
        help="Measured after each forward pass, before eviction.",
    )
    heap[1].metric("Dead share", f"{outcome.result.dead_share:.0%}", help="Free slots among those in use at the end.")
    heap[2].metric(
        "Compactions", f"{outcome.result.compactions:,}", help="How often a layer of the heap was compacted."
    )
    heap[3].metric(
        "Tokens kept per layer", f"{outcome.result.mean_kept_tokens:,}", help="Mean over layers, per KV head."
    )
    kept = st.columns(4)
    needle = result.trace.needle_held()
    kept[0].metric(
        "Needle tokens held",
        "—" if needle is None else f"{needle:.0%}",
        help="Share of the fact sentence's tokens still in the cache (any KV head), mean over layers.",
    )
    kept[1].metric(
        "Prefill (engine)",
        f"{outcome.result.prefill_seconds:.2f} s",
        help="The engine's own time (model and eviction); drawing excluded.",
    )
    kept[2].metric(
        "Decode (engine)",
        f"{outcome.result.decode_seconds:.2f} s",
        help="The engine's own time (model and eviction); drawing excluded.",
    )
    stored = "not stored" if filed.run_id is None else f"stored as run {filed.run_id}"
    st.caption(
        f"Question: {plain(prompt.question or '(none)')} · {stored}. KV bytes are read from the K/V tensors the "
        f"cache holds; the full-cache figure is computed for the same dtype and shapes. Tokens kept per "
        f"layer: {result.trace.kept_per_layer()}."
    )
