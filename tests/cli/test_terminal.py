"""Text from users and files reaches the terminal with its control and bidirectional characters escaped, through one
helper that every command's output goes through."""

from __future__ import annotations

import io

from kvlab.cli import main
from kvlab.cli.terminal import SafeStream, one_line, shown
from kvlab.provenance import Provenance
from kvlab.store import RunConfig, Trial, open_store

TITLE = "\x1b]0;owned\x07"  # sets the terminal's title
REVERSED = "abc\u202edcba"  # shows its tail reversed


def test_controls_and_bidi_characters_are_escaped_lines_are_kept():
    assert shown(f"model {TITLE}\n") == "model \\x1b]0;owned\\x07\n"
    assert shown(REVERSED) == "abc\\u202edcba"
    assert shown("tab\tand\rreturn\n") == "tab\tand\rreturn\n"  # a progress bar's return stays
    assert shown("\x9b31m \u2066x\u2069 \u200f") == "\\x9b31m \\u2066x\\u2069 \\u200f"
    assert shown("naïve café ✓ 日本") == "naïve café ✓ 日本"
    assert one_line("two\nlines\rover") == "two\\nlines\\rover"


def test_a_stream_writes_through_the_helper():
    target = io.StringIO()
    stream = SafeStream(target)
    assert stream.write(TITLE) == len(TITLE)
    assert target.getvalue() == "\\x1b]0;owned\\x07" and stream.getvalue() == target.getvalue()


def test_a_stored_model_name_is_printed_escaped_by_the_runs_command(tmp_path, capsys):
    path = tmp_path / "runs.duckdb"
    with open_store(path) as store:
        run_id = store.begin_run(
            RunConfig(model=f"evil{TITLE}{REVERSED}", policy="h2o", mode="decode", task="needle", keep=0.5),
            provenance=Provenance("0.0.0", None, {}),
        )
        store.add_trials(run_id, [Trial("t", "needle-0", 1024, correct=True)])
    assert main(["runs", "--db", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out and "\\x1b]0;owned\\x07" in out
