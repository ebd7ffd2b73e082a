"""Entry point of ``python -m kvlab``."""

from kvlab.cli import run

run()
