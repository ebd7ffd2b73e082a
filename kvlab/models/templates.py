"""A model's chat template checked before kvlab renders prompts with it.

A chat template is a program (Jinja, in transformers' sandbox) that ships with a checkpoint or inside a GGUF file.
The sandbox keeps it from the file system, but not from running for ever (loops nested over ``range(100000)``) or
from building a string of gigabytes (``'x' * 100000000``). Before the model's weights load, the template renders
one short conversation in a separate process with a time limit and a memory limit; a template that does not finish,
runs out of memory, turns one short line into a flood of text, or reaches out of its sandbox is refused in one
sentence. A template that fails
on the probe for an ordinary reason (it raises, it needs a variable) is left for the real render to report. The
verdict is kept per template for the life of the process.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

from kvlab.errors import KvlabError

#: Seconds a template may take to render the probe.
PROBE_SECONDS = 10.0
#: Address space the probe's process may use.
PROBE_MEMORY_BYTES = 4 << 30
#: Characters the probe may render into: a chat turn around one short line is a few hundred.
PROBE_CHARACTERS = 64 << 10

_PROBE = """
import json, resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))  # here, not in a preexec_fn: the caller may have threads
from jinja2.exceptions import SecurityError
from transformers.utils.chat_template_utils import render_jinja_template
given = json.load(sys.stdin)
try:
    text = render_jinja_template(
        [[{"role": "user", "content": "Hello."}]], chat_template=given["template"], add_generation_prompt=True,
        **given["special"],
    )[0][0]
except MemoryError:
    sys.exit(3)
except SecurityError:
    sys.exit(4)
except Exception:
    sys.exit(0)  # an ordinary failure: the real render reports it
print(len(text))
"""


@functools.lru_cache(maxsize=32)
def _probe(template: str, special: str) -> str | None:
    """Why the template may not be rendered (a clause), or None."""
    given = json.dumps({"template": template, "special": json.loads(special)})
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, str(PROBE_MEMORY_BYTES)],
            input=given,
            capture_output=True,
            text=True,
            timeout=PROBE_SECONDS,
        )
    except subprocess.TimeoutExpired:
        return f"did not render a one-line prompt within {PROBE_SECONDS:g} s"
    if done.returncode == 3 or (done.returncode != 0 and "MemoryError" in done.stderr):
        return f"ran out of {PROBE_MEMORY_BYTES >> 30} GiB rendering a one-line prompt"
    if done.returncode == 4:
        return "tries to leave its sandbox (it reaches for Python's internals)"
    length = done.stdout.strip()
    if done.returncode == 0 and length.isdigit() and int(length) > PROBE_CHARACTERS:
        return f"renders a one-line prompt into {int(length):,} characters"
    return None


def check_chat_template(template: object, special_tokens: dict[str, str], shown: str) -> None:
    """Refuse, in one sentence naming the model ``shown``, a chat template that would not end, would exhaust the
    memory or floods one line with text (see the module's description); nothing to check without a template."""
    if not isinstance(template, str) or not template:
        return
    reason = _probe(template, json.dumps(special_tokens, sort_keys=True))
    if reason is not None:
        raise KvlabError(f"The chat template of {shown} {reason}; kvlab does not run it.")
