#!/usr/bin/env bash
# Refreshes the README's screenshots in docs/screenshots/ by running the browser tests with that directory as their
# output (the test suite itself writes its screenshots to a temporary directory); --all, since they are marked long.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KVLAB_SCREENSHOTS="$root/docs/screenshots" exec bash "$root/scripts/test.sh" --all tests/browser/test_browser.py \
    tests/browser/test_browser_claims.py -s
