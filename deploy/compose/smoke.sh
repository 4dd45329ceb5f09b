#!/usr/bin/env bash
# Smoke test of the compose cluster: build the image from a fresh wheel, start the cluster,
# schedule and send messages, receive every one of them, and read the servers' metrics.
#
#   deploy/compose/smoke.sh          (KEEP=1 leaves the cluster running afterwards)
#
# Needs docker with the compose plugin and python3 with pip on the host.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PYTHON:-python3}"
cd "$here"

rm -rf dist
"$python" -m pip wheel --quiet --no-deps --wheel-dir dist "$repo"

compose() { docker compose --project-directory "$here" "$@"; }
client() { compose run --rm --no-deps -T client "$@"; }

finish() {
    status=$?
    compose logs --no-color >"$here/smoke-logs.txt" 2>&1 || true
    if [[ "${KEEP:-0}" != 1 ]]; then
        compose down --volumes --remove-orphans >/dev/null 2>&1 || true
    fi
    if [[ $status -ne 0 ]]; then
        echo "smoke: FAILED (server logs in $here/smoke-logs.txt)" >&2
    fi
    exit $status
}
trap finish EXIT

compose build
compose up -d
meta=metaserver:20880
subject="smoke.orders.$(date +%s)"

# Retry until the cluster takes it: the servers register, the metaserver chooses the
# scheduler master, and the slave must be in sync before a SCHEDULE is answered.
retry() {
    local tries=0
    until "$@"; do
        tries=$((tries + 1))
        if [[ $tries -ge 60 ]]; then
            echo "smoke: gave up on: $*" >&2
            return 1
        fi
        sleep 2
    done
}

delayed="$(retry client send --meta "$meta" --count 20 --delay 5s "$subject" later)"
immediate="$(retry client send --meta "$meta" --count 5 "$subject" now)"
expected="$(printf '%s\n%s\n' "$delayed" "$immediate" | sort)"
echo "smoke: sent $(wc -l <<<"$expected") messages (20 due in 5 s) to $subject"

received="$(client consume --meta "$meta" --group smoke --from earliest --max 25 --timeout 60s --json "$subject" \
    | "$python" -c 'import json, sys; print("\n".join(sorted(json.loads(line)["id"] for line in sys.stdin)))')"
if [[ "$received" != "$expected" ]]; then
    echo "smoke: received ids differ from the ids sent" >&2
    diff <(echo "$expected") <(echo "$received") >&2 || true
    exit 1
fi
echo "smoke: received all 25, each once"

# The metrics: every endpoint answers; the scheduler master dispatched the 20, the
# realtime groups stored the 25 (each group holds its share of the subjects).
"$python" - <<'PY'
import sys
import urllib.request

def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples

endpoints = {"metaserver": 9180, "realtime-1": 9181, "realtime-2": 9182, "scheduler-a": 9183, "scheduler-b": 9184}
scraped = {name: scrape(port) for name, port in endpoints.items()}
stored = sum(s.get("delaymq_realtime_messages_stored_total", 0) for s in scraped.values())
dispatched = max(s.get("delaymq_scheduler_messages_dispatched_total", 0) for s in scraped.values())
servers = scraped["metaserver"].get("delaymq_metaserver_servers", 0)
print(f"smoke: metrics: {servers:.0f} servers registered, {stored:.0f} messages stored, {dispatched:.0f} dispatched")
if servers < 5 or stored < 25 or dispatched < 20:
    sys.exit("smoke: the metrics do not show the workload")
PY
echo "smoke: OK"
