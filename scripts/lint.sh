#!/usr/bin/env bash
# Lint, formatting, types, the layering and the documentation: ruff check, ruff format --check, mypy and lint-imports
# (kvlab's layers and no import circle; all configured in pyproject.toml), then a strict build of the documentation site (mkdocs.yml: a broken link, a missing page or a
# docstring the API reference cannot render fails it), in .venv. The site is built into a temporary directory that is
# removed afterwards, so nothing is written into the tree. scripts/test.sh runs it before the tests, so CI fails on
# any of them.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/install.sh" | tail -n 1)"
cd "$root"
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/mypy"
"$venv/bin/lint-imports" --no-cache
if [ ! -x "$venv/bin/mkdocs" ]; then
  echo "mkdocs is not installed in $venv: install kvlab's docs extra (KVLAB_EXTRAS with docs in it)." >&2
  exit 1
fi
# The build's log is shown only when it fails. Not --quiet: it hides the warnings that --strict turns into a failure.
# The two variables silence notices that themes and plugins print on every build.
docs="$(mktemp -d)"
trap 'rm -rf "$docs"' EXIT
if ! NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true \
    "$venv/bin/mkdocs" build --strict --site-dir "$docs/site" >"$docs/build.log" 2>&1; then
  cat "$docs/build.log" >&2
  echo "The documentation site does not build (mkdocs build --strict): see the warnings above." >&2
  exit 1
fi
