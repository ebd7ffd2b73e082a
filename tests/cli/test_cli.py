"""The command line: figures as JSON, and one clear sentence with a non-zero status for every bad input."""

from __future__ import annotations

import json
import re

import pytest

from kvlab.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_generate_json_reports_measured_figures(checkpoint, capsys):
    prompt = "the cache keeps the tokens that matter " * 6
    status, out, _ = run(
        capsys,
        "generate",
        "--model",
        checkpoint,
        "--prompt",
        prompt,
        "--policy",
        "streaming",
        "--budget",
        "16",
        "--mode",
        "streaming",
        "--chunk",
        "8",
        "--max-new-tokens",
        "5",
        "--json",
    )
    assert status == 0
    figures = json.loads(out)
    for key in ("text", "tokens", "context_tokens", "kv_bytes", "kv_bytes_full", "peak_kv_bytes", "kept_per_layer"):
        assert key in figures
    layers, kv_heads, head_dim = 3, 2, 16
    per_token = 2 * layers * kv_heads * head_dim * 4
    assert figures["kept_per_layer"] == [16] * layers
    assert figures["kv_bytes"] == 16 * per_token
    assert figures["peak_kv_bytes"] == (16 + 8) * per_token
    seen = figures["context_tokens"] + len(figures["tokens"]) - 1
    assert figures["kv_bytes_full"] == seen * per_token
    assert figures["context_tokens"] > 16
    assert figures["attention"] == "sdpa"  # auto on a CPU


def test_generate_takes_an_attention_backend_and_refuses_an_unknown_one(checkpoint, capsys):
    common = ["generate", "--model", checkpoint, "--prompt", "a b c d e f", "--max-new-tokens", "3", "--json"]
    status, out, _ = run(capsys, *common, "--attention", "flex")
    assert status == 0 and json.loads(out)["attention"] == "flex"
    status, _, err = run(capsys, *common, "--attention", "triton")
    assert status == 2 and "--attention: invalid choice: 'triton'" in err


def test_generate_reads_the_prompt_by_the_bos_rule_and_refuses_an_unknown_one(checkpoint, capsys):
    common = ["generate", "--model", checkpoint, "--prompt", "a b c d e f", "--max-new-tokens", "3", "--json"]
    contexts = {}
    for rule in ("auto", "always", "never"):
        status, out, _ = run(capsys, *common, "--bos", rule)
        assert status == 0 and json.loads(out)["bos"] == rule
        contexts[rule] = json.loads(out)["context_tokens"]
    assert contexts == {"auto": contexts["never"], "always": contexts["never"] + 1, "never": contexts["never"]}
    status, _, err = run(capsys, *common, "--bos", "first")
    assert status == 2 and "--bos: invalid choice: 'first'" in err


def test_generate_reads_a_prompt_file_and_takes_policy_parameters(checkpoint, tmp_path, capsys):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("the tokens that matter " * 10, encoding="utf-8")
    status, out, _ = run(
        capsys,
        "generate",
        "--model",
        checkpoint,
        "--prompt-file",
        str(prompt_file),
        "--policy",
        "snapkv",
        "--param",
        "window=4",
        "--param",
        "kernel=3",
        "--keep",
        "0.5",
        "--json",
    )
    assert status == 0
    figures = json.loads(out)
    assert figures["params"] == {"window": 4, "kernel": 3, "pooling": "avg"}
    assert figures["budget_tokens"] == -(-figures["context_tokens"] // 2)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--budget", "0"], "argument --budget: a budget must be at least 1, not 0"),
        (["--budget", "-3"], "a budget must be at least 1, not -3"),
        (["--budget", str(2**63)], "at most 1,099,511,627,776"),
        (["--keep", "1.5"], "more than 0 and at most 1"),
        (["--keep", "0"], "more than 0 and at most 1"),
        (["--policy", "streaming", "--budget", "4"], "smaller than streaming's minimum of 5"),
        (["--policy", "snapkv", "--budget", "20"], "observation window of 32"),
        (["--policy", "magic", "--budget", "10"], "Unknown policy 'magic'"),
        (["--policy", "h2o", "--budget", "10", "--param", "heavy=3"], "has no parameter 'heavy'"),
        (["--policy", "h2o", "--budget", "10", "--param", "recent_ratio=lots"], "must be a number"),
        (
            ["--policy", "h2o", "--budget", "10", "--param", "recent_ratio=1.5"],
            "(more than 0 and less than 1), not 1.5",
        ),
        (["--policy", "h2o"], "needs a budget"),
        (["--policy", "full", "--keep", "0.5"], "takes no budget"),
        (
            ["--policy", "streaming", "--budget", "10", "--mode", "streaming", "--chunk", "0"],
            "a chunk must be at least 1",
        ),
    ],
)
def test_bad_inputs_exit_non_zero_with_one_sentence(checkpoint, capsys, argv, message):
    status, out, err = run(capsys, "generate", "--model", checkpoint, "--prompt", "hello", *argv)
    assert status != 0
    assert out == ""
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_an_empty_model_name_is_refused_not_replaced_by_the_default(capsys):
    status, out, err = run(capsys, "generate", "--model", " ", "--prompt", "hello")
    assert status == 2 and out == ""
    assert "No model was named" in err


def test_a_fraction_below_the_policy_minimum_is_refused_once_the_context_is_known(checkpoint, capsys):
    status, _, err = run(
        capsys,
        "generate",
        "--model",
        checkpoint,
        "--prompt",
        "the cache " * 10,
        "--policy",
        "streaming",
        "--keep",
        "0.05",
    )
    assert status == 2
    assert "keep 0.05 of" in err and "minimum of 5" in err


def test_the_command_line_starts_without_loading_torch():
    """``kvlab --help``, ``runs`` and ``export`` answer in a fraction of a second: building the parser must not
    import torch (the commands that run a model import it when they run)."""
    import subprocess
    import sys

    code = "import sys, kvlab.cli; kvlab.cli.build_parser(); print('torch' in sys.modules)"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert shown == "False"


def test_generate_says_what_the_cache_kept_against_the_prompt(checkpoint, capsys):
    """A budget smaller than the prompt evicts, and the figures line shows it: tokens kept per layer beside the
    prompt's length, and the bytes in use as a share of what a full cache would hold."""
    argv = ["generate", "--model", checkpoint, "--prompt", "the cache keeps the tokens that matter " * 6]
    tail = ["--mode", "streaming", "--chunk", "8", "--max-new-tokens", "4"]
    status, _, err = run(capsys, *argv, "--policy", "streaming", "--budget", "16", *tail)
    assert status == 0
    figures = re.search(
        r"prompt ([\d,]+) tokens, 4 generated, budget 16; the cache kept 16 tokens per layer; "
        r"KV in use ([\d,]+) B \((\d+)% of the ([\d,]+) B a full cache would hold\)",
        err,
    )
    assert figures is not None, err
    prompt_tokens, in_use, share, full = (int(group.replace(",", "")) for group in figures.groups())
    assert prompt_tokens > 16
    assert in_use < full and share == round(100 * in_use / full)

    status, _, err = run(capsys, *argv, "--policy", "full", *tail)
    assert status == 0
    kept = prompt_tokens + 4 - 1  # every token read: the prompt and the generated tokens but the last
    assert f"the cache kept {kept} tokens per layer; KV in use" in err and "(100% of the" in err


def test_generate_shows_a_range_when_layers_keep_different_numbers(checkpoint, capsys):
    argv = ["generate", "--model", checkpoint, "--prompt", "the tokens that matter " * 12, "--max-new-tokens", "2"]
    pyramid = ["--policy", "pyramidkv", "--param", "window=4", "--budget", "24"]
    status, out, _ = run(capsys, *argv, *pyramid, "--json")
    assert status == 0
    kept = json.loads(out)["kept_per_layer"]
    assert min(kept) < max(kept)
    status, _, err = run(capsys, *argv, *pyramid)
    assert status == 0
    assert f"the cache kept {min(kept)} to {max(kept)} tokens per layer (mean {round(sum(kept) / len(kept))})" in err
