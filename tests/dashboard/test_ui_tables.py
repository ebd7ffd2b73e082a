"""Table shapers, store figures, widget inputs and downloads, on a store filled with known trials (no model)."""

from __future__ import annotations

import io
import re

import numpy as np
import pandas as pd
import pytest

from kvlab.costs import GPU_PRESETS, MODEL_PRESETS, Scenario, compare, cost_table, formatted_costs
from kvlab.dashboard import cost_view, grid_figures, inputs
from kvlab.dashboard.cost_view import cost_bars
from kvlab.dashboard.downloads import export_bytes
from kvlab.dashboard.grid_figures import needle_heatmaps
from kvlab.dashboard.store_figures import frontier_figure
from kvlab.errors import KvlabError
from kvlab.provenance import Provenance
from kvlab.runs import tables
from kvlab.stats import bootstrap_interval, wilson_interval
from kvlab.store import RunConfig, RunFilter, Store, Trial, open_store

PROVENANCE = Provenance("0.1.0", "abc", {"python": "3"})
MODEL = "/models/kvlab-tiny-llama"


def add_run(
    store: Store,
    policy: str,
    keep: float | None,
    outcomes: dict[float, list[bool]],
    *,
    context: int = 512,
    budget_tokens: int | None = None,
    chunk: int | None = None,
    kv_bytes: int = 1000,
) -> int:
    run_id = store.begin_run(
        RunConfig(
            model=MODEL,
            policy=policy,
            mode="prefill",
            task="needle",
            keep=keep,
            budget_tokens=budget_tokens,
            chunk=chunk,
            context_length=context,
        ),
        provenance=PROVENANCE,
    )
    trials = [
        Trial(
            trial_key=f"{depth}/{i}",
            task_id="t",
            context_tokens=context,
            correct=ok,
            exact=ok,
            depth=depth,
            kept_tokens=int(context * (keep or 1)),
            kv_bytes=kv_bytes,
            peak_kv_bytes=2 * kv_bytes,
            prefill_s=0.5,
            decode_s=0.1,
        )
        for depth, oks in outcomes.items()
        for i, ok in enumerate(oks)
    ]
    store.add_trials(run_id, trials)
    store.finish_run(run_id)
    return run_id


@pytest.fixture
def store(tmp_path) -> Store:
    store = open_store(tmp_path / "runs.duckdb")
    add_run(store, "full", None, {0.003: [True], 0.497: [True], 0.991: [True]}, kv_bytes=8000)
    add_run(store, "h2o", 0.1, {0.003: [False, True], 0.497: [False], 0.991: [True]}, kv_bytes=900)
    add_run(store, "h2o", 0.1, {0.52: [True]}, chunk=256, kv_bytes=900)  # same label, pooled with the run above
    add_run(store, "h2o", 0.3, {0.497: [True]}, kv_bytes=2500)
    add_run(store, "streaming", 0.1, {0.497: [False]}, kv_bytes=900)
    add_run(store, "streaming", None, {0.497: [True]}, budget_tokens=128, kv_bytes=1100)
    yield store
    store.close()


def test_budget_and_run_labels():
    assert tables.budget_label(0.1, None) == "keep 10%"
    assert tables.budget_label(0.125, None) == "keep 12.5%"
    assert tables.budget_label(float("nan"), 256) == "256 tokens"
    assert tables.budget_label(None, pd.NA) == "full cache"
    assert tables.run_label("h2o", "prefill", 0.1) == "h2o · prefill · keep 10%"
    assert tables.run_label("full", "prefill") == "full cache"
    assert tables.short_model_name(MODEL) == "kvlab-tiny-llama"
    assert tables.short_model_name("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"


def test_needle_grid_rounds_depths_and_pools_runs_of_one_label(store):
    runs = grid_figures.at_budget(store.list_runs(), 0.1)
    assert set(runs["policy"]) == {"full", "h2o", "streaming"} and len(runs) == 4
    cells = grid_figures.needle_grid(store.accuracy_by_depth(RunFilter(run_ids=tuple(runs["run_id"]))), runs)
    h2o = cells[cells["label"] == "h2o · prefill · keep 10%"].set_index("depth")
    assert list(h2o.index) == [0.0, 0.5, 1.0]
    assert h2o.loc[0.0, "accuracy"] == 50 and h2o.loc[0.0, "trials"] == 2
    assert h2o.loc[0.5, "accuracy"] == 50 and h2o.loc[0.5, "trials"] == 2  # 0.497 and 0.52 from two runs
    assert set(cells["context_length"]) == {512}


def test_needle_heatmaps_draw_one_panel_per_label(store):
    runs = grid_figures.at_budget(store.list_runs(), 0.1)
    cells = grid_figures.needle_grid(store.accuracy_by_depth(RunFilter(run_ids=tuple(runs["run_id"]))), runs)
    figure = needle_heatmaps(cells)
    assert [heatmap.type for heatmap in figure.data] == ["heatmap"] * 3
    assert {a.text for a in figure.layout.annotations} == set(cells["label"])
    h2o = figure.data[1]
    assert np.asarray(h2o.z).shape == (1, 3) and (h2o.zmin, h2o.zmax) == (0, 100)
    assert list(h2o.x) == ["0%", "50%", "100%"]
    assert "n=2" in h2o.text[0][0]
    empty = needle_heatmaps(cells.iloc[0:0])
    assert "No stored needle trials" in empty.layout.annotations[0].text


def test_pareto_front():
    cost = np.array([1.0, 2.0, 3.0, 2.0, 4.0])
    accuracy = np.array([10.0, 50.0, 40.0, 50.0, 90.0])
    assert tables.pareto_front(cost, accuracy).tolist() == [True, True, False, True, True]


def test_frontier_points_on_the_kept_fraction_and_byte_axes(store):
    frontier = store.accuracy_frontier()
    by_keep = tables.frontier_points(frontier, "keep")
    assert "streaming · prefill · 128 tokens" not in set(by_keep["label"])  # a token budget has no single fraction
    full = by_keep[by_keep["label"] == "full cache"].iloc[0]
    assert full["x"] == 1.0 and full["y"] == 100
    assert set(by_keep[by_keep["front"]]["label"]) == {"h2o · prefill · keep 10%", "h2o · prefill · keep 30%"}
    assert set(by_keep["line"]) == {"full cache", "h2o · prefill", "streaming · prefill"}
    by_bytes = tables.frontier_points(frontier, "kv_bytes")
    assert "streaming · prefill · 128 tokens" in set(by_bytes["label"])
    cheapest = by_bytes.sort_values("x").iloc[0]
    assert cheapest["x"] == 900
    front = set(by_bytes[by_bytes["front"]]["label"])
    assert front == {"h2o · prefill · keep 10%", "streaming · prefill · 128 tokens"}
    figure = frontier_figure(by_bytes, "KV bytes", bytes_axis=True)
    assert figure.layout.xaxis.type == "log" and figure.layout.xaxis.title.text == "KV bytes"
    assert "KiB" in " ".join(figure.layout.xaxis.ticktext)  # round binary ticks, not plotly's 2 3 4 5 in MiB
    assert figure.data[-1].name == "Pareto front" and len(figure.data[-1].x) == len(front)
    assert len(figure.data) == 1 + len(set(by_bytes["line"]))
    assert tables.frontier_points(frontier.iloc[0:0]).empty


def test_each_point_finds_exactly_its_own_trials(store):
    trials = store.trials_frame()
    points = tables.frontier_points(store.accuracy_frontier(), "kv_bytes", trials=trials)
    found = [tables.point_trials(trials, point) for point in points.itertuples(index=False)]
    assert [len(rows) for rows in found] == points["trials"].tolist()  # the full cache's NaN keys match too
    assert sum(len(rows) for rows in found) == len(trials)  # every trial is behind exactly one point
    assert all(set(rows["policy"]) == {point.policy} for rows, point in zip(found, points.itertuples(index=False)))


def test_frontier_lines_at_the_same_fraction_are_drawn_apart_and_named_together(store):
    points = tables.frontier_points(store.accuracy_frontier(), "keep")
    figure = frontier_figure(points, "kept fraction", bytes_axis=False)
    at_ten = {trace.meta: trace.x[0] for trace in figure.data[:-1] if trace.meta != "full cache"}
    assert at_ten["h2o · prefill"] != at_ten["streaming · prefill"]  # both keep 10 %
    assert abs(at_ten["h2o · prefill"] - at_ten["streaming · prefill"]) < 0.05
    low, high = figure.layout.xaxis.range
    assert all(low < x < high for trace in figure.data for x in trace.x)
    hover = figure.data[1].customdata[0][1]
    assert hover.startswith("At keep 10%") and "streaming · prefill · 0 % (n=1)" in hover
    drawn = {(trace.line.color, trace.marker.symbol, trace.line.dash) for trace in figure.data[:-1]}
    assert len(drawn) == len(figure.data) - 1  # every line drawn its own way


def test_runs_table_and_comparison(store):
    runs = store.list_runs()
    table = tables.runs_table(runs)
    assert list(table["run"]) == sorted(runs["run_id"], reverse=True)
    assert table.loc[table["run"] == 2, "accuracy %"].item() == 50.0
    assert table.loc[table["run"] == 6, "budget"].item() == "128 tokens"
    assert set(table["attention"]) == {"sdpa"}  # stored without a backend: kvlab's own kernels
    assert table.columns.get_loc("heap layout") < table.columns.get_loc("attention") < table.columns.get_loc("trials")
    picked = runs[runs["run_id"].isin([1, 2])]
    compared = tables.compare_runs(picked, store.trials_frame(RunFilter(run_ids=(1, 2))))
    assert list(compared.columns) == ["run 1", "run 2"]
    assert compared.loc["budget", "run 2"] == "keep 10%"
    assert compared.loc["mean KV bytes at end (measured)", "run 1"] == "7.81 KiB"  # 8,000 bytes
    assert compared.loc["trials", "run 2"] == "4"
    assert all(isinstance(value, str) for value in compared.to_numpy().ravel())


def test_stored_keep_fractions_and_choices(store):
    options = cost_view.stored_keep_fractions(store.list_runs())
    assert sorted(set(options.values())) == [0.1, 0.25, 0.3]  # 128 of 512 tokens is 25 %
    assert not any("full cache" in label for label in options)
    runs = store.list_runs()
    assert tables.choices(runs, "policy") == ["full", "h2o", "streaming"]
    assert tables.choices(runs, "keep", policy="h2o") == [0.1, 0.3]
    assert tables.most_runs(runs, "policy") == ["h2o", "streaming", "full"]


def test_cost_table_is_written_out_for_reading():
    scenario = Scenario(prompt_tokens=7_168, output_tokens=1_024, batch=8, keep_fraction=0.25)
    model, gpu = MODEL_PRESETS["Llama-3-8B"], GPU_PRESETS["H100 SXM 80GB"]
    shown = formatted_costs(cost_table(model, gpu, scenario)).set_index("Quantity")
    assert shown.loc["Sequences that fit beside the weights", "Full cache"] == "57"
    assert shown.loc["Sequences that fit beside the weights", "Evicted (keep 25%)"] == "228"
    assert shown.loc["KV per token, all layers", "Full cache"] == "128 KiB"
    assert shown.loc["Batch fits in memory", "Full cache"] == "yes"
    assert shown.loc["Cost per query", "Full cache"].startswith("$0.000998")
    figure = cost_bars(*compare(model, gpu, scenario))
    assert len(figure.data) == 4 and list(figure.data[1].y) == [57, 228]


def test_uploads_that_are_not_text_are_refused():
    assert inputs.read_upload("notes.txt", "\ufeffhello".encode()) == "hello"
    with pytest.raises(KvlabError, match="binary"):
        inputs.read_upload("model.bin", b"\x00\x01\x02")
    with pytest.raises(KvlabError, match="not UTF-8"):
        inputs.read_upload("latin.txt", "café".encode("latin-1"))
    with pytest.raises(KvlabError, match="empty"):
        inputs.read_upload("blank.txt", b"  \n")


def test_pasted_configs():
    config = (
        '{"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, '
        '"num_key_value_heads": 8, "hidden_size": 4096}'
    )
    spec = inputs.model_spec_from_json(config, 8.03)
    assert spec.arch.num_kv_heads == 8 and spec.params == pytest.approx(8.03e9)
    with pytest.raises(KvlabError, match="not valid JSON .* line 1"):
        inputs.model_spec_from_json("{num_hidden_layers: 32}", 8)
    with pytest.raises(KvlabError, match="JSON object"):
        inputs.model_spec_from_json("[1, 2]", 8)
    with pytest.raises(KvlabError, match="parameter count"):
        inputs.model_spec_from_json(config, 0)
    with pytest.raises(KvlabError, match="decoder-only transformer"):
        inputs.model_spec_from_json('{"hidden_size": 4096}', 8)


def test_policy_fields_and_summaries():
    fields = {field.name: field for field in inputs.policy_fields("snapkv")}
    assert fields["pooling"].choices == ("avg", "max") and fields["window"].kind is int
    assert inputs.policy_fields("h2o")[0].kind is float and inputs.policy_fields("full") == []
    assert inputs.policy_summary("h2o").startswith("H2O (Zhang et al.")
    assert "`sinks`" in inputs.policy_summary("streaming")


def test_gpu_fields_become_a_gpu():
    gpu = inputs.gpu_spec("edited", 80, 3350, 989, 2.5)
    assert gpu.memory_bytes == 80 << 30 and gpu.bandwidth_bytes_per_s == 3.35e12 and gpu.price_per_hour == 2.5


def test_downloads_are_what_the_exporters_write(store):
    trials = pd.read_csv(io.BytesIO(export_bytes(store, "trials", ".csv", RunFilter(run_ids=(2,)))))
    assert len(trials) == 4 and {"run_id", "policy", "keep", "correct", "kv_bytes", "git_commit"} <= set(trials.columns)
    runs = pd.read_parquet(io.BytesIO(export_bytes(store, "runs", ".parquet")))
    assert sorted(runs["run_id"]) == [1, 2, 3, 4, 5, 6]


def test_user_text_is_escaped_for_markdown_and_no_address_becomes_a_link():
    from kvlab.dashboard.text import WORD_JOINER, plain, plain_frame

    escaped = plain("![x](https://h/p.png) **b** www.h.org ann@h.org :red[r] $x$ <img>")
    assert "![" not in escaped and "**" not in escaped and "<img>" not in escaped and "$x$" not in escaped
    assert "https:" + WORD_JOINER in escaped.replace("\\", "") and "www" + WORD_JOINER in escaped
    assert "@" + WORD_JOINER in escaped.replace("\\", "")
    unescaped = re.sub(r"\\(.)", r"\1", escaped).replace(WORD_JOINER, "")
    assert unescaped == "![x](https://h/p.png) **b** www.h.org ann@h.org :red[r] $x$ <img>"
    frame = plain_frame(pd.DataFrame({"a*": ["**x**", 3]}, index=["[i]", "j"]))
    assert list(frame.columns) == ["a\\*"] and frame.iloc[0, 0] == "\\*\\*x\\*\\*" and frame.iloc[1, 0] == 3
    assert list(frame.index) == ["\\[i\\]", "j"]


def test_a_run_names_its_heap_layout_and_threshold():
    assert tables.layout_label("threshold", 0.5) == "threshold at 50%"
    assert tables.layout_label("bitmask", None) == "bitmask"
    assert tables.layout_label(None, None) == "—"  # stored before the heap had layouts


def test_runs_with_other_policy_parameters_are_other_lines():
    assert tables.policy_name("streaming", '{"sinks": 0}') == "streaming (sinks=0)"
    assert tables.policy_name("streaming", '{"sinks": 4}') == "streaming"  # the default is not repeated
    assert tables.run_label("streaming", "streaming", None, 256, {"sinks": 32}) == (
        "streaming (sinks=32) · streaming · 256 tokens"
    )
    frontier = pd.DataFrame(
        {
            "policy": ["streaming", "streaming"],
            "policy_params": ['{"sinks": 0}', '{"sinks": 4}'],
            "mode": ["streaming", "streaming"],
            "keep": [None, None],
            "budget_tokens": [256, 256],
            "perplexity": [27.2, 16.1],
            "mean_peak_kv_bytes": [5.9e6, 5.9e6],
            "trials": [1, 1],
        }
    )
    points = tables.frontier_points(frontier, "peak_kv_bytes", "perplexity")
    assert sorted(points["line"]) == ["streaming (sinks=0) · streaming", "streaming · streaming"]
    assert points.set_index("line")["front"].to_dict() == {
        "streaming (sinks=0) · streaming": False,
        "streaming · streaming": True,
    }


# --- uncertainty: intervals, tie shares, paired tests ---------------------------------------------------------------


def hand_trials(run_id: int, correct: list[bool], **columns: list) -> pd.DataFrame:
    """Trials of one run as ``Store.trials_frame`` gives them, with the columns a test needs."""
    return pd.DataFrame(
        {"run_id": run_id, "correct": pd.array(correct, dtype="boolean"), "exact": pd.array(correct, dtype="boolean")}
        | columns
    )


def test_runs_show_each_share_with_its_interval_and_the_tie_share(store):
    runs = store.list_runs()
    trials = store.trials_frame()
    table = tables.runs_table(tables.with_shares(runs, tables.run_shares(trials))).set_index("run")
    assert table.loc[2, "accuracy %"] == 50.0 and table.loc[2, "accuracy 95% CI"] == "15–85"  # Wilson, 2 of 4
    assert table.loc[2, "exact 95% CI"] == "15–85"
    assert table.loc[2, "recall 95% CI"] == "—" and table.loc[2, "tie share"] == "—"  # not recorded then
    assert tables.runs_table(runs).loc[0, "accuracy 95% CI"] == "—"  # without the trials, no interval is invented
    recall = hand_trials(2, [True, False, False, True], recall=[1.0, 0.5, 0.0, 0.75], tie_share=[0.25, 0.5, None, 0.0])
    shares = tables.run_shares(recall).loc[2]
    assert shares["recall"] == pytest.approx(0.5625) and shares["tie_share"] == pytest.approx(0.25)
    assert (shares["accuracy_low"], shares["accuracy_high"]) == pytest.approx(wilson_interval(2, 4))
    assert (shares["recall_low"], shares["recall_high"]) == bootstrap_interval([1.0, 0.5, 0.0, 0.75])
    shown = tables.runs_table(tables.with_shares(runs, tables.run_shares(recall))).set_index("run")
    assert shown.loc[2, "recall %"] == 56.2 and shown.loc[2, "tie share"] == "25.0 %"
    assert shown.loc[1, "recall %"] != shown.loc[1, "recall %"]  # NaN: run 1 has no trials in this frame
    assert shown.loc[1, "accuracy %"] == 100.0  # the store's own accuracy stays
    compared = tables.compare_runs(runs[runs["run_id"] == 2], recall)
    assert compared.loc["accuracy % (95% CI)", "run 2"] == "50.0 (15–85)"
    assert compared.loc["tie share at the eviction cut", "run 2"] == "25.0 %"
    assert compared.loc["mean KV bytes read per decoded token (measured)", "run 2"] == "—"


def test_frontier_points_carry_intervals_drawn_as_whiskers(store):
    frontier = store.accuracy_frontier()
    points = tables.frontier_points(frontier, "kv_bytes", "accuracy", store.trials_frame())
    h2o = points[points["label"] == "h2o · prefill · keep 10%"].iloc[0]  # 3 of 5 over two pooled runs
    assert (h2o["low"], h2o["high"]) == pytest.approx(tuple(100 * b for b in wilson_interval(3, 5)))
    table = tables.frontier_table(points, "kv_bytes", "accuracy").set_index("run")
    assert table.loc["h2o · prefill · keep 10%", "95% CI"] == "23–89"
    figure = frontier_figure(points, "KV bytes", bytes_axis=True)
    whiskers = {trace.meta: trace.error_y for trace in figure.data[:-1]}
    assert whiskers["h2o · prefill"].visible and max(whiskers["h2o · prefill"].array) > 0
    assert "95% CI 23–89, n=5" in figure.data[1].customdata[0][1]
    assert tables.frontier_points(frontier, "kv_bytes")["low"].isna().all()  # no trials given: no whiskers
    assert tables.frontier_points(frontier, "kv_bytes", "recall").empty  # a store without recalls
    trials = store.trials_frame()
    trials["recall"] = np.where(trials["correct"].astype(bool), 1.0, 0.5)  # RULER: fractions of expected strings
    recalls = tables.frontier_points(frontier.assign(recall=0.8), "kv_bytes", "recall", trials)
    h2o = recalls[recalls["label"] == "h2o · prefill · keep 10%"].iloc[0]
    expected = bootstrap_interval([0.5, 1.0, 0.5, 1.0, 1.0])  # the two pooled runs' trials, in the store's order
    assert (h2o["low"], h2o["high"]) == pytest.approx(tuple(100 * bound for bound in expected))


def test_the_read_bytes_axis_falls_back_to_held_bytes_and_says_so(store):
    frontier = store.accuracy_frontier()
    held = tables.frontier_points(frontier, "read_bytes")
    assert held["held_fallback"].all() and sorted(held["x"]) == sorted(frontier["mean_kv_bytes"])
    assert tables.axis_title(held, "read_bytes").endswith(tables.HELD_FALLBACK)
    assert "(held)" in tables.frontier_table(held, "read_bytes", "accuracy").iloc[0, 1]
    read = frontier.assign(mean_read_bytes=np.where(frontier["policy"] == "h2o", 100.0, np.nan))
    points = tables.frontier_points(read, "read_bytes")
    assert set(points.loc[~points["held_fallback"], "x"]) == {100.0}
    assert points.loc[points["held_fallback"], "policy"].ne("h2o").all()
    assert tables.axis_title(points.iloc[:0], "read_bytes") == tables.FRONTIER_AXES["read_bytes"]


def test_needle_cells_have_intervals_and_recall_cells_a_bootstrap(store):
    runs = grid_figures.at_budget(store.list_runs(), 0.1)
    cells = grid_figures.needle_grid(store.accuracy_by_depth(RunFilter(run_ids=tuple(runs["run_id"]))), runs)
    h2o = cells[cells["label"] == "h2o · prefill · keep 10%"].set_index("depth")
    assert (h2o.loc[0.0, "low"], h2o.loc[0.0, "high"]) == pytest.approx(tuple(100 * b for b in wilson_interval(1, 2)))
    figure = needle_heatmaps(cells)
    assert figure.data[1].text[0][0] == "50%<br>9–91<br>n=2"
    assert "accuracy %{z:.0f}% (95% CI %{customdata[1]})" in figure.data[1].hovertemplate
    trials = pd.DataFrame(
        {
            "run_id": 2,
            "context_length": 512,
            "context_tokens": 512,
            "trial_key": ["a", "b", "c", "d"],
            "depth": 0.5,
            "correct": [True, False, False, True],
            "recall": [1.0, 0.5, 0.0, 0.75],
        }
    )
    [cell] = grid_figures.needle_grid(grid_figures.depth_accuracy(trials), runs).itertuples(index=False)
    assert cell.recall and cell.accuracy == pytest.approx(56.25) and cell.trials == 4
    assert (cell.low, cell.high) == pytest.approx(tuple(100 * b for b in bootstrap_interval([1.0, 0.5, 0.0, 0.75])))
    recall_figure = needle_heatmaps(pd.DataFrame([cell._asdict()]))
    assert "recall %{z:.0f}%" in recall_figure.data[0].hovertemplate
    assert recall_figure.data[0].colorbar.title.text == "recall %"


def test_two_runs_on_the_same_items_are_tested_in_pairs():
    items = [f"item-{i}" for i in range(30)]
    a = hand_trials(1, [True] * 30, item_hash=items)
    b = hand_trials(2, [True] * 18 + [False] * 12, item_hash=items)
    elsewhere = hand_trials(3, [True] * 30, item_hash=[f"other-{i}" for i in range(30)])
    runs = pd.DataFrame({"run_id": [1, 2, 3]})
    paired = tables.paired_tests(runs, pd.concat([a, b, elsewhere]), "accuracy").set_index(["A", "B"])
    one_two = paired.loc[("run 1", "run 2")]
    assert (one_two["items both answered"], one_two["only A right"], one_two["only B right"]) == ("30", "12", "0")
    assert one_two["McNemar p"] == f"{2 / 2**12:.2g}" and one_two["test"] == "exact binomial"
    assert one_two["B − A, points (95% CI)"].startswith("-40.0 (") and one_two["reading"].startswith("A right")
    not_comparable = paired.loc[("run 1", "run 3")]
    assert not_comparable["reading"] == f"not comparable: 0 items pair up, fewer than {tables.MIN_PAIRED_ITEMS}"
    assert not_comparable["McNemar p"] == "—"
    same = tables.paired_test(a, a.assign(run_id=4), "A", "B")
    assert same["reading"] == "no difference shown at the 5% level" and same["McNemar p"] == "1"
    few = tables.paired_test(a.iloc[:9], b.iloc[:9], "A", "B")
    assert few["items both answered"] == "9" and few["reading"].startswith("not comparable")
