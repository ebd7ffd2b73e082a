"""Property-based tests (Hypothesis) of the two doors user input comes in by: the command line's arguments and the
JSONL task reader. Whatever comes in ends in a result or one sentence, never a traceback, within bounded time and
memory."""

from __future__ import annotations

import contextlib
import io
import json
import re
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab.cli import main
from kvlab.errors import KvlabError
from kvlab.models import loading as models
from kvlab.models.limits import Limits
from kvlab.tasks.items import TaskItem, load_jsonl

COMMANDS = ("generate", "policies", "sweep", "eval", "runs", "export")
FLAGS = (
    "--model",
    "--device",
    "--dtype",
    "--trust-remote-code",
    "--prompt",
    "--prompt-file",
    "--policy",
    "--param",
    "--keep",
    "--budget",
    "--mode",
    "--chunk",
    "--seed",
    "--max-new-tokens",
    "--json",
    "--policies",
    "--contexts",
    "--depths",
    "--trials",
    "--task",
    "--batch-size",
    "--query-agnostic",
    "--no-share-prefill",
    "--quiet",
    "--tasks",
    "--db",
    "--out",
    "--table",
    "--run-id",
    "--context-length",
    "--help",
)
AWKWARD = (
    "",
    " ",
    "nan",
    "inf",
    "-inf",
    "-1",
    "0",
    "1",
    "0.5",
    "1.0",
    "1e400",
    "2",
    "9223372036854775808",
    "1,2,,3",
    ",",
    "random",
    "h2o,streaming",
    "full",
    "snapkv",
    "sinks=-10",
    "window=0",
    "kernel=4",
    "h2o.recent_ratio=2",
    "random.seed=3",
    "pooling=median",
    "cpu",
    "cpu:5",
    "cuda:7",
    "tpu",
    "prefill",
    "streaming",
    "prefill,streaming",
    "needle-multikey",
    "trials",
    "runs",
    "x.csv",
    "x.parquet",
    "x.xlsx",
    "\x00",
    "\ud800",
    "m" * 300,
)
VALUES = st.one_of(
    st.sampled_from(AWKWARD),
    st.text(max_size=24),
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)
ARGUMENTS = st.one_of(
    st.tuples(
        st.one_of(st.sampled_from(COMMANDS), VALUES), st.lists(st.one_of(st.sampled_from(FLAGS), VALUES), max_size=14)
    ),
    st.tuples(
        st.sampled_from(COMMANDS),
        st.lists(st.tuples(st.sampled_from(FLAGS), VALUES), max_size=8).map(
            lambda pairs: [part for pair in pairs for part in pair]
        ),
    ),
)
PROGRESS = re.compile(r"\d+/\d+ \[[\d:<?]+")


class ReachedTheModel(KvlabError):
    """Raised instead of loading a model: the arguments got through every check that needs no model."""


def no_model(*args, **kwargs):
    raise ReachedTheModel("the arguments were accepted up to loading the model.")


def confined(value: str, directory: Path) -> str:
    """Keep generated paths inside the test's directory: a value that looks absolute is moved into it."""
    return str(directory / value.lstrip("/~").replace("\x00", "")) if value.startswith(("/", "~")) else value


@pytest.mark.slow
@settings(max_examples=400, deadline=5000, suppress_health_check=[HealthCheck.too_slow])
@given(arguments=ARGUMENTS)
def test_any_command_line_ends_in_a_result_or_one_sentence(arguments, tmp_path_factory):
    command, rest = arguments
    directory = tmp_path_factory.mktemp("cli")
    argv = [confined(command, directory), *(confined(value, directory) for value in rest)]
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(directory)
        patch.setenv("KVLAB_DB", str(directory / "runs.duckdb"))
        patch.setenv("KVLAB_LOG", str(directory / "kvlab.log"))
        patch.setattr(models, "load_model", no_model)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(argv)
    said = [line for line in err.getvalue().split("\n") if line.strip() and not PROGRESS.search(line)]
    assert status in (0, 2), (argv, err.getvalue())  # 1 would be a bug caught by the guard
    assert "Traceback" not in err.getvalue() and "Traceback" not in out.getvalue()
    assert len(said) <= 1, (argv, said)
    if status == 2:
        assert len(said) == 1 and said[0].startswith("error: "), (argv, said)
    assert not (directory / "kvlab.log").exists()


# --- the JSONL reader ----------------------------------------------------------------------------------------------

TEXT = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=60)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
RECORDS = st.fixed_dictionaries(
    {"id": TEXT, "context": TEXT, "question": TEXT, "answer": TEXT},
    optional={"extra": JSON_VALUES},
)
LINES = st.one_of(
    RECORDS.map(lambda record: json.dumps(record, ensure_ascii=False) if _encodable(record) else json.dumps(record)),
    JSON_VALUES.map(json.dumps),
    TEXT,
    st.integers(1, 60_000).map(lambda depth: "[" * depth + "]" * depth),
    st.integers(1, 60_000).map(lambda depth: '{"a":' * depth + "1" + "}" * depth),
    st.integers(1, 40_000).map(
        lambda size: json.dumps({"id": "big", "context": "word " * size, "question": "q", "answer": "a"})
    ),
)


def _encodable(record: dict) -> bool:
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models.default_model())


@pytest.mark.model
@settings(
    max_examples=200, deadline=5000, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(lines=st.lists(LINES, max_size=6))
def test_any_task_file_reads_as_tasks_or_one_sentence(lines, tokenizer, tmp_path):
    path = tmp_path / "tasks.jsonl"
    with path.open("w", encoding="utf-8", errors="surrogatepass") as handle:
        handle.write("\n".join(lines))
    tracemalloc.start()
    try:
        items = load_jsonl(path, tokenizer, Limits(positions=256), new_tokens=8)
    except KvlabError as error:
        assert "\n" not in str(error) and str(error).endswith((".", ")"))
    else:
        assert items and all(isinstance(item, TaskItem) for item in items)
        assert all(item.context_tokens + 8 <= 256 and item.answer.strip() for item in items)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB"
