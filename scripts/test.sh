#!/usr/bin/env bash
# Installs kvlab and its extras into .venv (scripts/install.sh), then:
#   scripts/test.sh          checks lint, formatting, types and the documentation build (scripts/lint.sh) and runs
#                            every test not marked long: under 10 minutes on 2 CPU cores;
#   scripts/test.sh --all    the same checks and every test, the long ones too (the published models, the browser
#                            tests, compiles, a wheel, killed processes): what CI runs;
#   scripts/test.sh --fast   checks lint and formatting (ruff only) and runs the tests not marked slow, browser,
#                            model or long (pytest.ini declares the markers): under 2 minutes, for the edit-and-test
#                            loop.
# Any further arguments go to pytest, e.g. scripts/test.sh -k engine, scripts/test.sh --fast tests/cache; a -m among
# them replaces the run's own (scripts/test.sh -m model runs the long model tests too).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
run="default"
if [ "${1:-}" = "--fast" ] || [ "${1:-}" = "--all" ]; then
  run="${1#--}"
  shift
fi
venv="$(bash "$root/scripts/install.sh" | tail -n 1)"
cd "$root"
case "$run" in
  fast)
    "$venv/bin/ruff" check .
    "$venv/bin/ruff" format --check .
    exec "$venv/bin/python" -m pytest -m "not slow and not browser and not model and not long" "$@"
    ;;
  all)
    bash "$root/scripts/lint.sh"
    exec "$venv/bin/python" -m pytest "$@"
    ;;
  *)
    bash "$root/scripts/lint.sh"
    exec "$venv/bin/python" -m pytest -m "not long" "$@"
    ;;
esac
