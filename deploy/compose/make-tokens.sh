#!/usr/bin/env bash
# Make the compose cluster's tokens: a secret of its own for each server group, one for the
# `client` service and one for Prometheus, and the tokens file every server reads, which
# holds only each secret's SHA-256 (docs/operations.md, "Authentication").
#
#   deploy/compose/make-tokens.sh [DIR]      (default: tokens/ beside this file; smoke.sh runs it)
#
#   DIR/tokens.toml        the servers' --tokens-file (mounted read-only): token_sha256 only
#   DIR/realtime-1.env     DELAYMQ_TOKEN=<secret> of group realtime-1 (servers = ["realtime:realtime-1"]),
#   DIR/realtime-2.env     of realtime-2, and of scheduler-1 (both its members): each service's
#   DIR/scheduler-1.env    env_file, so no secret is on a command line
#   DIR/client.env         the `client` service's: producer, and consumer of groups smoke and demo*
#   DIR/prometheus.token   the bearer token the metrics endpoints take (role metrics)
#
# A DIR that holds a tokens.toml is left as it is: delete DIR for new secrets (then
# `docker compose up -d --force-recreate`). Needs coreutils only.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dir="${1:-$here/tokens}"
if [[ -f "$dir/tokens.toml" ]]; then
    echo "make-tokens: $dir holds tokens already; kept them" >&2
    exit 0
fi
if [[ -e "$dir/tokens.toml" ]]; then  # a folder, made by docker mounting a tokens file that was not there
    echo "make-tokens: $dir/tokens.toml is not a file: remove it, then run this again" >&2
    exit 1
fi
mkdir -p "$dir"
umask 077  # the secrets' files: readable by their owner only

secret() { od -An -tx1 -N32 /dev/urandom | tr -d ' \n'; }
digest() { printf '%s' "$1" | sha256sum | cut -d' ' -f1; }

entries=""
# add NAME FILE LINE...: a secret in DIR/FILE (an .env file: as DELAYMQ_TOKEN), its [[token]] with LINEs.
add() {
    local name="$1" file="$2" value line
    shift 2
    value="$(secret)"
    if [[ "$file" == *.env ]]; then
        printf 'DELAYMQ_TOKEN=%s\n' "$value" >"$dir/$file"
    else
        printf '%s\n' "$value" >"$dir/$file"
    fi
    entries+=$'\n[[token]]\n'"name = \"$name\""$'\n'"token_sha256 = \"$(digest "$value")\""$'\n'
    for line in "$@"; do
        entries+="$line"$'\n'
    done
}

add realtime-1 realtime-1.env 'roles = ["server"]' 'servers = ["realtime:realtime-1"]'
add realtime-2 realtime-2.env 'roles = ["server"]' 'servers = ["realtime:realtime-2"]'
add scheduler-1 scheduler-1.env 'roles = ["server"]' 'servers = ["scheduler:scheduler-1"]'
add client client.env 'roles = ["producer", "consumer"]' 'groups = ["smoke", "demo*"]'
# Role metrics: it may read the metrics, and send nothing but PING, ROUTE and STATUS.
add prometheus prometheus.token 'roles = ["metrics"]' 'requests_per_s = 10'

{
    echo "# Made by make-tokens.sh: the SHA-256 of each secret, the secrets beside this file."
    printf '%s' "$entries"
} >"$dir/tokens.toml.new"
chmod 0644 "$dir/tokens.toml.new"  # read by the servers' user in the containers; it holds no secret
mv "$dir/tokens.toml.new" "$dir/tokens.toml"
echo "make-tokens: wrote the tokens to $dir" >&2
