"""The one bounded reader of files a user names: devices, pipes, directories and giants refused from ``stat``
before a byte is read, one sentence each, through every command that reads such a file."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab import files
from kvlab.cli import main
from kvlab.errors import KvlabError
from kvlab.tasks.items import load_jsonl
from kvlab.tasks.texts import read_text


def test_a_regular_file_is_read_and_its_limit_holds(tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text("héllo")
    assert files.read_text(path, "prompt file") == "héllo"
    with pytest.raises(KvlabError, match="larger than the 5 B kvlab reads from a file; set KVLAB_MAX_FILE_MIB"):
        files.read_bytes(path, "prompt file", limit=5)
    (tmp_path / "latin.txt").write_bytes(b"\xe9t\xe9")
    with pytest.raises(KvlabError, match="is not UTF-8 text"):
        files.read_text(tmp_path / "latin.txt", "text file")


def test_devices_pipes_directories_and_missing_files_are_refused_before_reading(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path, sentence in [
        ("/dev/zero", "a device, pipe or socket, not a regular file"),
        (fifo, "a device, pipe or socket, not a regular file"),  # reading would block: refused without opening
        (tmp_path, "it is a directory"),
        (tmp_path / "absent.txt", "No such file"),
    ]:
        with pytest.raises(KvlabError, match=sentence):
            files.read_bytes(path, "prompt file")


def test_a_sparse_giant_is_refused_by_its_size(tmp_path, monkeypatch):
    giant = tmp_path / "giant.txt"
    with giant.open("wb") as handle:
        handle.truncate(8 << 30)  # 8 GiB of holes: no disk used, no byte read
    with pytest.raises(KvlabError, match="larger than the 512 MiB"):
        files.read_bytes(giant, "task file")
    monkeypatch.setenv(files.MAX_FILE_ENV, "1")
    small = tmp_path / "two_mib.txt"
    small.write_bytes(b"x" * (2 << 20))
    with pytest.raises(KvlabError, match="larger than the 1.00 MiB"):
        read_text(small, "text file")
    for bad in ("0", "-3", "1e9", "lots"):
        monkeypatch.setenv(files.MAX_FILE_ENV, bad)
        with pytest.raises(KvlabError, match="KVLAB_MAX_FILE_MIB must be a positive whole number of MiB"):
            files.most_file_bytes()


def test_task_files_and_text_files_go_through_the_bounded_reader(tmp_path):
    with pytest.raises(KvlabError, match="Cannot read the task file /dev/zero: it is a device"):
        load_jsonl("/dev/zero", tokenizer=None)
    with pytest.raises(KvlabError, match="Cannot read the text file /dev/zero: it is a device"):
        read_text("/dev/zero")


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--prompt-file", "{fifo}", "--policy", "full"],
        ["live", "--text-file", "{fifo}", "--question", "q", "--answer", "a"],
        ["quality", "--text", "/dev/zero"],
        ["eval", "--tasks", "/dev/zero"],
    ],
)
def test_commands_refuse_a_pipe_or_a_device_in_one_sentence_without_hanging(command, tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    argv = [part.replace("{fifo}", str(fifo)) for part in command]
    done: list[int] = []
    worker = threading.Thread(target=lambda: done.append(main(argv)), daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert done == [2], "the command hung or failed otherwise"
    err = capsys.readouterr().err
    assert "not a regular file" in err and len(err.strip().splitlines()) == 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=4096), limit=st.integers(min_value=1, max_value=5000))
def test_any_file_is_read_whole_within_its_limit_or_refused_in_one_sentence(tmp_path, data, limit):
    path = tmp_path / "input.bin"
    path.write_bytes(data)
    if len(data) <= limit:
        assert files.read_bytes(path, "input file", limit=limit) == data
    else:
        with pytest.raises(KvlabError) as refused:
            files.read_bytes(path, "input file", limit=limit)
        assert "\n" not in str(refused.value) and "KVLAB_MAX_FILE_MIB" in str(refused.value)
    try:
        text = files.read_text(path, "input file", limit=max(limit, len(data)))
    except KvlabError as error:
        assert str(error).endswith("is not UTF-8 text.")
    else:
        assert text.encode("utf-8") == data


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(["file", "empty", "fifo", "device", "directory", "missing", "link"]), size=st.integers(0, 64)
)
def test_any_kind_of_path_is_read_or_refused_in_one_sentence_without_blocking(tmp_path, kind, size):
    path = tmp_path / f"input-{kind}-{size}"
    if kind in ("file", "empty"):
        path.write_bytes(b"x" * (size if kind == "file" else 0))
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "link":
        path.symlink_to("/dev/zero")
    elif kind == "device":
        path = Path("/dev/zero")
    try:
        data = files.read_bytes(path, "input file", limit=32)
    except KvlabError as error:
        assert "\n" not in str(error) and str(error).endswith(".")
        assert kind in ("fifo", "device", "directory", "missing", "link") or size > 32
    else:
        assert kind in ("file", "empty") and len(data) == (size if kind == "file" else 0) <= 32
