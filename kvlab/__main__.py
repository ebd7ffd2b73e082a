"""Entry point of ``python -m kvlab``.

Run from the folder that holds a clone named ``kvlab``, Python finds the clone's folder first and imports it as an
empty namespace package in place of an editable install's kvlab: the package's ``__init__`` never runs, and a command
would fail halfway (its version missing when the run's provenance is recorded). That is refused here, in one
sentence, before anything runs.
"""

import sys

import kvlab

if getattr(kvlab, "__file__", None) is None:
    _shadow = next(iter(kvlab.__path__), "kvlab")
    sys.exit(
        f"error: the folder {_shadow} hides the kvlab package from here (a clone run from the folder that holds it); "
        "run kvlab from inside the clone or from any other folder."
    )

from kvlab.console import run  # noqa: E402  (only once the package is known to be the real one)

run()
