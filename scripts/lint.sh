#!/usr/bin/env bash
# Lint, formatting and types: ruff check, ruff format --check and mypy (configured in pyproject.toml), in .venv.
# scripts/test.sh runs it before the tests, so CI fails on any of them.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/install.sh" | tail -n 1)"
cd "$root"
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/mypy"
