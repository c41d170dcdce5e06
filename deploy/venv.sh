#!/usr/bin/env bash
# Prints the path of rein's virtualenv, creating it first if needed.
#
#   deploy/venv.sh          ensure the venv exists and points at this checkout; print its path on stdout
#   deploy/venv.sh --path   only print the path it would use (creates nothing)
#
# The venv lives outside the checkout, in ${REIN_CACHE:-$HOME/.cache/rein}/venv-<hash12>, where the hash
# covers the Python version and the dependency spec in pyproject.toml (build requires, requires-python,
# dependencies, the installed extras): changing a dependency makes a new venv, editing anything else
# does not. A `.complete` marker means every dependency installed; a half-built venv is rebuilt.
# Then rein itself is installed editable (--no-deps), so the `rein` script and imports use the current
# checkout, wherever it was cloned. Progress goes to stderr, the path alone to stdout.
#
# Knobs (environment, optional): REIN_CACHE, REIN_EXTRAS (default "test"), PYTHON (default python3).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${REIN_CACHE:-$HOME/.cache/rein}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${REIN_EXTRAS:-test}"
# shellcheck source=deploy/common.sh
source "$REPO/deploy/common.sh"

command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found: rein needs Python 3.11+"

# Prints "<hash12>" on line 1, then one requirement per line (dependencies + the chosen extras).
spec="$("$PYTHON" - "$REPO/pyproject.toml" "$EXTRAS" <<'PY'
import hashlib, json, sys
if sys.version_info < (3, 11):
    sys.exit(f"venv.sh: error: rein needs Python 3.11+, {sys.executable} is {sys.version.split()[0]}")
import tomllib
with open(sys.argv[1], "rb") as f:
    doc = tomllib.load(f)
project = doc.get("project", {})
extras = [e for e in sys.argv[2].split(",") if e]
optional = project.get("optional-dependencies", {})
missing = [e for e in extras if e not in optional]
if missing:
    sys.exit(f"venv.sh: error: pyproject.toml has no optional-dependencies {missing}")
reqs = list(project.get("dependencies", [])) + [r for e in extras for r in optional[e]]
key = {
    "python": sys.version.split()[0],
    "requires-python": project.get("requires-python"),
    "build": doc.get("build-system", {}).get("requires", []),
    "extras": extras,
    "requirements": reqs,
}
print(hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12])
print("\n".join(reqs))
PY
)" || exit 1

hash="$(head -n 1 <<<"$spec")"
VENV="$CACHE/venv-$hash"

if [[ "${1:-}" == "--path" ]]; then
    echo "$VENV"
    exit 0
fi
[[ $# -eq 0 ]] || die "usage: venv.sh [--path]"

mkdir -p "$CACHE"
# One builder at a time per venv (parallel make targets, two test runs).
exec 9>"$VENV.lock"
flock 9

if [[ ! -f "$VENV/.complete" ]]; then
    log "building $VENV (first run for this dependency spec; torch is large, pip's cache makes reruns fast)"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV" >&2
    "$VENV/bin/python" -m pip install -q -U pip "setuptools>=68" wheel >&2
    mapfile -t reqs < <(tail -n +2 <<<"$spec")
    "$VENV/bin/python" -m pip install --progress-bar off "${reqs[@]}" >&2 ||
        die "pip could not install the dependencies into $VENV"
    echo "$hash" >"$VENV/.complete"
    log "dependencies installed"
fi

# Editable install of this checkout; skipped when the same checkout with the same pyproject is already in.
stamp="$REPO $(sha256sum "$REPO/pyproject.toml" | cut -c1-16)"
if [[ ! -f "$VENV/.editable" || "$(cat "$VENV/.editable")" != "$stamp" || ! -x "$VENV/bin/rein" ]]; then
    log "installing $REPO into $VENV (editable, no deps)"
    "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$REPO" >&2 ||
        die "pip install -e $REPO failed"
    echo "$stamp" >"$VENV/.editable"
fi

echo "$VENV"
