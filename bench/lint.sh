#!/usr/bin/env bash
# Lint and types as CI runs them (README, Development and tests), after ruff's safe fixes.
# Rerun after a merge: the fixes take care of import order and the like; what is left is listed
# for a person to fix. Every module mypy checks ([tool.mypy] files) is held to zero errors.
# Arguments go to mypy (e.g. --python-executable); RUFF=... and MYPY=... pick other binaries.
set -uo pipefail
cd "$(dirname "$0")/.."
RUFF=${RUFF:-ruff}
MYPY=${MYPY:-mypy}
"$RUFF" check --fix strata tests bench
ruff_rc=$?
"$MYPY" "$@"
mypy_rc=$?
exit $((ruff_rc || mypy_rc))
