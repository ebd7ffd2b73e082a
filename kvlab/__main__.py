"""Entry point of ``python -m kvlab``."""

from kvlab.console import run

run()
