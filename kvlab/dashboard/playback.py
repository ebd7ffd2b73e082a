"""A stored run played pass by pass: a scrubber over its steps and a Play button that advances it one step at a time.

The button sits outside the replay and reruns the whole page when pressed, so that the replay's fragment is drawn
again with a timer (every :data:`PLAY_STEP_S` while playing, none while paused): each tick redraws the replay alone,
one step further, never the rest of the page. Two runs side by side share one scrubber, so they play in step.
"""

from __future__ import annotations

from collections.abc import Sequence

import streamlit as st
from streamlit.delta_generator import DeltaGenerator

#: Seconds between two steps while playing.
PLAY_STEP_S = 0.6


def next_position(positions: Sequence[int], current: int) -> int | None:
    """The step after ``current`` among ``positions`` (sorted), or ``None`` at the end."""
    return next((position for position in positions if position > current), None)


def _keys(key: str) -> tuple[str, str, str]:
    """The session-state keys of the scrubber's position, of whether it plays, and of whether Play was just
    pressed (the step it was pressed at is drawn before the first move)."""
    return f"{key}-position", f"{key}-playing", f"{key}-pressed"


def is_playing(key: str) -> bool:
    """Whether the replay under ``key`` is playing."""
    return bool(st.session_state.get(_keys(key)[1]))


def play_button(slot: DeltaGenerator, positions: Sequence[int], key: str) -> bool:
    """Play or Pause for the replay under ``key``; pressed at the last step, Play starts again from the first.
    Whether it plays now (the page's replay fragment ticks while it does)."""
    position_key, playing_key, pressed_key = _keys(key)

    def toggle() -> None:  # a callback: it may move the scrubber before the page draws it again
        playing = not is_playing(key)
        st.session_state[playing_key] = playing
        st.session_state[pressed_key] = playing
        if playing and next_position(positions, st.session_state.get(position_key, positions[-1])) is None:
            st.session_state[position_key] = positions[0]

    playing = is_playing(key)
    slot.button(
        "Pause" if playing else "Play",
        icon=":material/pause:" if playing else ":material/play_arrow:",
        key=f"{key}-play",
        on_click=toggle,
        help="Play the run step by step (every prefill chunk, compression and generated token), from where the "
        "scrubber is.",
    )
    return playing


def scrubber(slot: DeltaGenerator, positions: Sequence[int], key: str, label: str, help: str) -> int:
    """The scrubber over ``positions`` (at the last step at first), moved one step further at every tick while the
    replay plays; at the end the replay stops. The position to draw."""
    position_key, playing_key, pressed_key = _keys(key)
    state = st.session_state
    if state.get(position_key) not in positions:
        state[position_key] = positions[-1]
    if state.get(playing_key) and not state.pop(pressed_key, False):
        following = next_position(positions, state[position_key])
        if following is None:
            state[playing_key] = False
            st.rerun(scope="app")  # the page again, its replay without a timer
        state[position_key] = following
    return int(slot.select_slider(label, list(positions), key=position_key, help=help))
