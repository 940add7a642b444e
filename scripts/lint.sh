#!/usr/bin/env bash
# Static checks, each run even when an earlier one failed; exit non-zero if any failed.
#   ruff check     style and real mistakes (pyproject [tool.ruff])
#   lint-imports   the architecture rules (pyproject [tool.importlinter]; docs/how-it-works.md "Layout")
#   mypy           types of the pure core, orchestrator/core (pyproject [tool.mypy])
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${VENV:-.venv}/bin
failed=()
step() {
    local name=$1; shift
    echo "== lint: $name"
    if "$@"; then echo "== lint: $name ok"; else echo "== lint: $name FAILED" >&2; failed+=("$name"); fi
}
for tool in ruff lint-imports mypy; do
    [ -x "$BIN/$tool" ] || { echo "lint: $BIN/$tool missing: run scripts/setup.sh (installs the [test] extra)" >&2; exit 2; }
done
step ruff "$BIN/ruff" check --output-format concise .
step import-linter "$BIN/lint-imports" --no-cache --no-logo
step mypy "$BIN/mypy"
if [ ${#failed[@]} -gt 0 ]; then
    echo "lint: FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "lint: ok (ruff, import-linter, mypy)"
