"""A chat template that would not end, would exhaust the memory or floods one line with text is refused in one
sentence before the model's weights load; an ordinary template passes, and one that fails for an ordinary reason is
left for the real render to report."""

from __future__ import annotations

import json

import pytest
from tiny_models import save_tiny_checkpoint

from kvlab.errors import KvlabError
from kvlab.models import templates
from kvlab.models.loading import load_model
from kvlab.models.templates import check_chat_template

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
ORDINARY = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "within"),
        ("{{ 'x' * 100000000 }}", "characters"),
        ("{{ 'x' * 5000000000 }}", "ran out of 4 GiB"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "tries to leave its sandbox"),
        ("{% for i in range(100000) %}{{ 'abcdefgh' }}{% endfor %}", "into 800,000 characters"),
    ],
)
def test_a_template_bomb_is_one_sentence(template, says, monkeypatch):
    monkeypatch.setattr(templates, "PROBE_SECONDS", 3.0)
    templates._probe.cache_clear()
    with pytest.raises(KvlabError, match=f"The chat template of 'm' .*{says}.*; kvlab does not run it"):
        check_chat_template(template, SPECIAL, "'m'")


def test_ordinary_templates_pass_and_ordinary_failures_are_left_to_the_render():
    check_chat_template(ORDINARY, SPECIAL, "'m'")
    check_chat_template("{{ raise_exception('no system role') }}", SPECIAL, "'m'")
    check_chat_template("{{ undefined_variable.attribute }}", SPECIAL, "'m'")
    check_chat_template(None, SPECIAL, "'m'")


def test_a_checkpoint_with_a_template_bomb_is_refused_before_its_weights_load(tmp_path):
    directory = save_tiny_checkpoint(tmp_path / "model")
    config_path = tmp_path / "model" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{{ 'x' * 100000000 }}"
    config_path.write_text(json.dumps(config))
    (tmp_path / "model" / "model.safetensors").write_bytes(b"not weights: never read")
    with pytest.raises(KvlabError, match="chat template of .* kvlab does not run it"):
        load_model(directory)
