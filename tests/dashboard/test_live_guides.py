"""The live charts' "how to read this" guides: one per figure, short, and true to what the figure draws."""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest
from test_ui_figures import trace  # noqa: F401  (the synthetic run, a fixture)
from test_ui_tiers import tiered  # noqa: F401  (a synthetic run that demotes, a fixture)

from kvlab.dashboard import live_figures as figures
from kvlab.dashboard.guides import ChartGuide

#: Each figure builder and the guide drawn beside it.
GUIDE_OF = {
    figures.memory_figure: figures.MEMORY_GUIDE,
    figures.tier_figure: figures.TIER_GUIDE,
    figures.sink_figure: figures.SINK_GUIDE,
    figures.head_entropy: figures.HEAD_ENTROPY_GUIDE,
    figures.attention_landscape: figures.LANDSCAPE_GUIDE,
    figures.cache_map: figures.CACHE_MAP_GUIDE,
    figures.entropy_over_time: figures.ENTROPY_GUIDE,
}


def sentences(text: str) -> int:
    return len(re.findall(r"[.!?](?:\s|$)", text))


def drawn_titles(figure) -> list[str]:
    """The axis and colour-bar titles a figure draws, without the parenthesised unit or note that may follow."""
    layout = figure.layout
    axes = [layout.xaxis, layout.yaxis, layout.scene.xaxis, layout.scene.yaxis, layout.scene.zaxis]
    titles = [axis.title.text for axis in axes]
    titles += [series.colorbar.title.text for series in figure.data if "colorbar" in series]
    return [title.split(" (")[0] for title in titles if title]


def test_every_figure_builder_has_a_guide_and_the_page_can_find_it():
    builders = {
        function
        for name, function in inspect.getmembers(figures, inspect.isfunction)
        if function.__module__ == figures.__name__ and inspect.signature(function).return_annotation == "go.Figure"
    }
    builders -= {figures._placeholder}
    assert builders == set(GUIDE_OF)
    assert sorted(figures.GUIDES.values(), key=id) == sorted(GUIDE_OF.values(), key=id)
    assert all(isinstance(guide, ChartGuide) for guide in figures.GUIDES.values())


@pytest.mark.parametrize("name", sorted(figures.GUIDES))
def test_each_guide_says_what_is_drawn_and_what_good_and_bad_runs_look_like_in_a_few_sentences(name):
    guide = figures.GUIDES[name]
    for part in (guide.axes, guide.good, guide.bad):
        assert 1 <= sentences(part) <= 3, part
        assert len(part) <= 400, part
    markdown = guide.markdown()
    assert guide.axes in markdown and guide.good in markdown and guide.bad in markdown


def test_each_guide_names_the_axes_its_figure_draws(trace, tiered):  # noqa: F811
    for build, guide in GUIDE_OF.items():
        figure = build(tiered if build is figures.tier_figure else trace)
        titles = drawn_titles(figure)
        assert titles, build.__name__
        missing = [title for title in titles if title.lower() not in guide.axes.lower()]
        assert not missing, (build.__name__, missing)


def test_the_guides_quote_the_figures_own_limits():
    landscape = figures.LANDSCAPE_GUIDE
    assert f"at most {figures.MAX_ROWS} rows" in landscape.axes
    assert f"from 1e{int(np.log10(figures.WEIGHT_FLOOR))}" in landscape.axes
    assert f"at least {figures.PILLAR_RATIO:g} times" in landscape.good
    assert f"up to {figures.MAX_COLUMNS} columns" in figures.CACHE_MAP_GUIDE.axes
    assert f"at most {figures.MAX_ROWS} columns" in figures.ENTROPY_GUIDE.axes
