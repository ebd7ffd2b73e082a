"""User-facing errors.

Every failure a user can cause (a bad budget, an unknown policy, a model that cannot be loaded, a locked database)
is raised as a :class:`KvlabError` whose message is one plain sentence. The CLI prints that sentence and exits
non-zero; the dashboard shows it on the page. Anything else is a bug and keeps its traceback.
"""

#: What a command says, and its exit status, when Ctrl-C ends it (at any moment: :mod:`kvlab.console`).
INTERRUPTED = "Interrupted."
INTERRUPTED_STATUS = 130
#: A quoted model name is cut to this many characters, so a pasted page cannot flood a message.
_SHOWN_NAME_CHARS = 80


def shown_name(name: str) -> str:
    """A model name as a sentence quotes it: shortened when it is long, so a pasted page cannot flood a message."""
    short = name if len(name) <= _SHOWN_NAME_CHARS else name[:_SHOWN_NAME_CHARS] + "…"
    return repr(short)


class KvlabError(Exception):
    """An error caused by the user's input or environment, described in one sentence."""


class NotAModel(KvlabError):
    """A model name that leads to no loadable causal language model: no such directory or hub model, no readable
    config, or a config of another kind of model. The dashboard answers all of these with one sentence, so that
    its model box cannot be used to learn which paths exist on the server."""


def not_fetched(shown: str) -> NotAModel:
    """The refusal of a hub model (or hub GGUF file) that the local cache does not hold while the hub cannot be
    reached; ``shown`` names it as :func:`shown_name` does."""
    return NotAModel(
        f"Could not fetch {shown} from the Hugging Face hub: there is no network connection and it is not in the "
        "local cache."
    )
