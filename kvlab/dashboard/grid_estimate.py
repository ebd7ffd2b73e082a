"""The Streamlit side of a needle grid's estimate (:mod:`kvlab.runs.estimate`): the speed of one timed pass, taken once
per server process and grid shape, and only while the device is free, so that it neither slows a run nor is slowed
by one."""

from __future__ import annotations

import functools

import streamlit as st

from kvlab.dashboard.grid import NeedleGridRequest
from kvlab.models.loading import LoadedModel
from kvlab.runs.device_queue import DEVICE_QUEUE, Waiting
from kvlab.runs.estimate import Speed, measure_speed, sweep_estimate
from kvlab.runs.sweep import SweepGrid
from kvlab.store import Store


class DeviceBusy(Exception):
    """Raised from the device queue's wait callback: a timed pass for an estimate never waits for a run."""


def give_up(waiting: Waiting) -> None:
    raise DeviceBusy


@st.cache_resource(show_spinner=False, max_entries=32)
def timed_speed(
    model: str,
    policies: tuple[str, ...],
    mode: str,
    shortest: int,
    batch: int,
    new_tokens: int,
    _grid: SweepGrid,
    _loaded: LoadedModel,
) -> Speed:
    """One timed pass at the grid's shape, once per server process and shape (the named arguments are the cache
    key), on the device only when nothing else runs there, so that it neither slows a run nor is slowed by one."""
    with DEVICE_QUEUE.turn(f"one timed pass of {batch} prompts for an estimate", give_up):
        return measure_speed(_loaded, _grid)


def measured(grid_request: NeedleGridRequest, grid: SweepGrid, model: LoadedModel) -> Speed | None:
    """The grid's timed speed, or None while the device is busy."""
    shape = (
        grid_request.policies,
        grid_request.mode,
        min(grid_request.contexts),
        grid_request.batch_size,
        grid.max_new_tokens,  # a RULER grid decodes longer answers than a needle grid
    )
    try:
        return timed_speed(model.name, *shape, grid, model)
    except DeviceBusy:
        return None


def grid_estimate(request: NeedleGridRequest, grid: SweepGrid, loaded: LoadedModel, store: Store | None) -> str:
    """What the grid will take, in one sentence: from the store's timings, else from one timed pass."""
    return sweep_estimate(loaded, grid, store, functools.partial(measured, request, grid, loaded))
