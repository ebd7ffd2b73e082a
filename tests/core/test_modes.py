"""The modes, named once: the engine runs exactly these, a name outside them is one sentence, and the help texts
describe each."""

from __future__ import annotations

from typing import get_args

import pytest

from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError
from kvlab.modes import MODE_TEXT, MODES, PREFILL, STREAMING, Mode, check_mode, modes_help
from kvlab.policies import make_policy


def test_the_modes_are_the_literal_type_s_and_a_run_refuses_any_other() -> None:
    assert MODES == get_args(Mode) == (PREFILL, STREAMING)
    with pytest.raises(KvlabError, match=r"^Unknown mode 'chunked'"):
        RunSpec(make_policy("full"), mode="chunked")  # type: ignore[arg-type]


def test_a_mode_is_checked_by_its_name() -> None:
    assert [check_mode(name) for name in ("prefill", "streaming")] == list(MODES)
    with pytest.raises(KvlabError, match=r"^Unknown mode 'Prefill'; use 'prefill' or 'streaming'\.$"):
        check_mode("Prefill")


def test_the_help_describes_every_mode_in_the_order_asked() -> None:
    assert set(MODE_TEXT) == set(MODES)
    text = modes_help((STREAMING, PREFILL))
    assert text.startswith("streaming: the budget holds all the time") and text.index("prefill:") > 0
