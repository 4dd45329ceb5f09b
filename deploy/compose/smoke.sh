#!/usr/bin/env bash
# Smoke test of the compose cluster: build the image from a fresh wheel, make the tokens
# (make-tokens.sh, unless tokens/ holds them), start the cluster, schedule and send messages,
# receive every one of them, and read the servers' metrics with the Prometheus token (a
# scrape without it is refused).
#
#   deploy/compose/smoke.sh          (KEEP=1 leaves the cluster, project delaymq-smoke, running)
#   BASE_IMAGE=delaymq-base:bookworm deploy/compose/smoke.sh    (the image's base: see Dockerfile)
#
# Needs docker with the compose plugin (`docker compose`; else `docker-compose` v1.29 is
# used) and python3 with pip on the host.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PYTHON:-python3}"
cd "$here"

rm -rf dist
"$python" -m pip wheel --quiet --no-deps --wheel-dir dist "$repo"

# compose.yaml reads BASE_IMAGE (its default: python:3.11-slim) as the Dockerfile's build arg.
export BASE_IMAGE="${BASE_IMAGE:-python:3.11-slim}"
if docker compose version >/dev/null 2>&1; then
    compose_command=(docker compose)
elif command -v docker-compose >/dev/null; then
    compose_command=(docker-compose)
else
    echo "smoke: needs docker compose (the plugin) or docker-compose" >&2
    exit 1
fi
# A project of its own (its containers and volumes are delaymq-smoke_*): the `down --volumes`
# at the end removes nothing of a cluster started here as project delaymq.
project="${SMOKE_PROJECT:-delaymq-smoke}"
compose() { "${compose_command[@]}" --project-directory "$here" --project-name "$project" "$@"; }
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

"$here/make-tokens.sh"
compose build
if ! compose up -d; then
    # An engine whose own open-file limit is below the compose file's 65536 cannot start the
    # servers ("error setting rlimit type 7"): DELAYMQ_NOFILE=<that limit> smoke.sh.
    echo "smoke: the cluster did not start (on \"error setting rlimit type 7\": set DELAYMQ_NOFILE)" >&2
    exit 1
fi
meta=metaserver:20880
subject="smoke.orders.$(date +%s)"

# Retry until the cluster takes it: the servers register and the metaserver chooses the
# scheduler master.
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
# 25, unless a send failed part way and was retried: the ids it printed were stored too.
sent="$(wc -l <<<"$expected")"
echo "smoke: sent $sent messages (20 due in 5 s) to $subject"

received="$(client consume --meta "$meta" --group smoke --from earliest --max "$sent" --timeout 60s --json "$subject" \
    | "$python" -c 'import json, sys; print("\n".join(sorted(json.loads(line)["id"] for line in sys.stdin)))')"
if [[ "$received" != "$expected" ]]; then
    echo "smoke: received ids differ from the ids sent" >&2
    diff <(echo "$expected") <(echo "$received") >&2 || true
    exit 1
fi
echo "smoke: received all $sent, each once"

# The metrics: every endpoint answers; the metaserver holds the four data servers (it does
# not count itself) up, scheduler-1 with one master and one slave; the scheduler master
# dispatched the 20, the realtime groups stored the 25 (each group its share of the subjects).
METRICS_TOKEN_FILE="$here/tokens/prometheus.token" "$python" - <<'PY'
import os
import re
import sys
import urllib.error
import urllib.request

with open(os.environ["METRICS_TOKEN_FILE"]) as file:
    token = file.read().strip()

def scrape(port, *, authorization=f"Bearer {token}"):
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": authorization})
    with urllib.request.urlopen(request, timeout=10) as answer:
        text = answer.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples

def labelled(samples, family):
    """{(group, kind): [values]} of a metaserver family labelled per server."""
    found = {}
    for name, value in samples.items():
        if name.startswith(family + "{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', name))
            found.setdefault((labels["group"], labels["kind"]), []).append(value)
    return found

endpoints = {"metaserver": 9180, "realtime-1": 9181, "realtime-2": 9182, "scheduler-a": 9183, "scheduler-b": 9184}
for port in endpoints.values():
    try:
        scrape(port, authorization="Bearer not-a-token-of-this-cluster")
    except urllib.error.HTTPError as refused:
        if refused.code != 401:
            sys.exit(f"smoke: a scrape with an unknown token was answered {refused.code}, not 401")
    else:
        sys.exit("smoke: a scrape with an unknown token was answered")
print("smoke: metrics: a scrape without a known token is refused (401)")
scraped = {name: scrape(port) for name, port in endpoints.items()}
meta = scraped["metaserver"]
stored = sum(s.get("delaymq_realtime_messages_stored_total", 0) for s in scraped.values())
dispatched = max(s.get("delaymq_scheduler_messages_dispatched_total", 0) for s in scraped.values())
servers = meta.get("delaymq_metaserver_servers", 0)
up = labelled(meta, "delaymq_metaserver_server_up")
masters = labelled(meta, "delaymq_metaserver_server_is_master")
print(f"smoke: metrics: {servers:.0f} servers registered, {stored:.0f} messages stored, {dispatched:.0f} dispatched")
print("smoke: metrics: " + ", ".join(
    f"{group} {sum(up[group, kind]):.0f} up, {sum(masters.get((group, kind), [])):.0f} master"
    for group, kind in sorted(up)))
expected_up = {("realtime-1", "realtime"): 1, ("realtime-2", "realtime"): 1, ("scheduler-1", "scheduler"): 2}
if {key: sum(values) for key, values in up.items()} != expected_up:
    sys.exit("smoke: the metaserver does not hold every server up")
if any(sum(masters.get(key, [])) != 1 for key in expected_up):
    sys.exit("smoke: a group has not exactly one master")
if servers != 4 or stored < 25 or dispatched < 20:
    sys.exit("smoke: the metrics do not show the workload")
PY
echo "smoke: OK"
