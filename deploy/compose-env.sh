#!/usr/bin/env bash
# Writes this deployment's secrets for docker compose, which refuses to start without them (docs/security.md).
#
#   deploy/compose-env.sh [FILE]            fill FILE (default: .env at the repo root, which compose reads)
#   deploy/compose-env.sh --new-run [FILE]  the same, with a new RUN_ID: session keys of the earlier run are refused
#
# Each of ADMIN_TOKEN (the operator's), RUNNER_TOKEN (the rollout runner's), SESSION_KEY_SECRET (signs the
# agents' session keys), RUN_ID and GRAFANA_ADMIN_PASSWORD is generated at random unless FILE already sets it:
# running it again changes nothing. Other lines of FILE are kept. FILE is written mode 0600.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
new_run=0
if [[ "${1:-}" == "--new-run" ]]; then
    new_run=1
    shift
fi
[[ $# -le 1 ]] || { echo "usage: compose-env.sh [--new-run] [FILE]" >&2; exit 2; }
FILE="${1:-$REPO/.env}"

touch "$FILE"
chmod 600 "$FILE"
if ((new_run)); then
    sed -i '/^RUN_ID=/d' "$FILE"
fi
random() { python3 -c "import secrets, sys; print(secrets.token_hex(int(sys.argv[1])))" "$1"; }
for entry in ADMIN_TOKEN:16 RUNNER_TOKEN:16 SESSION_KEY_SECRET:32 RUN_ID:6 GRAFANA_ADMIN_PASSWORD:12; do
    name="${entry%%:*}"
    if ! grep -q "^${name}=" "$FILE"; then
        value="$(random "${entry##*:}")"
        [[ "$name" == RUN_ID ]] && value="$(date -u +%Y%m%d-%H%M%S)-$value"
        echo "${name}=${value}" >>"$FILE"
        echo "compose-env.sh: wrote $name to $FILE" >&2
    fi
done
