#!/usr/bin/env bash
# Run the delaymq backlog job on a Spark cluster.
#
#   deploy/spark/submit.sh [SPARK-SUBMIT OPTIONS...] -- [JOB OPTIONS...]
#   deploy/spark/submit.sh --master yarn --deploy-mode cluster -- \
#       --scheduler-data hdfs:///delaymq/scheduler-1 --realtime-data hdfs:///delaymq/realtime-1 \
#       --out hdfs:///delaymq/backlog
#
# Builds the delaymq wheel (or takes DELAYMQ_WHEEL) and ships it to the driver and the
# executors with --py-files. A wheel is a zip archive, but Spark puts only .zip/.egg/.jar
# files of --py-files on the executors' sys.path, so the wheel is shipped under a .zip name.
# The executors' Python needs delaymq's dependencies (lmdb, msgpack, trio, sortedcontainers,
# pyarrow for non-local paths, plotly on the driver): install them there
# (pip install 'delaymq[spark]'), or pack a virtualenv with venv-pack and set
# DELAYMQ_PYENV=/path/env.tar.gz to ship it with --archives (used as the workers' Python).
# Paths may be local (file://, on storage every node sees), hdfs://, s3a://, gs://, ...
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PYTHON:-python3}"
spark_submit="${SPARK_SUBMIT:-spark-submit}"

submit_args=()
while [[ $# -gt 0 && "$1" != "--" ]]; do
    submit_args+=("$1")
    shift
done
[[ "${1:-}" == "--" ]] && shift

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

wheel="${DELAYMQ_WHEEL:-}"
if [[ -z "$wheel" ]]; then
    "$python" -m pip wheel --quiet --no-deps --wheel-dir "$work/dist" "$repo" >&2
    wheel="$(ls "$work"/dist/delaymq-*.whl)"
fi
cp "$wheel" "$work/delaymq.zip"

extra=()
if [[ -n "${DELAYMQ_PYENV:-}" ]]; then
    extra+=(--archives "${DELAYMQ_PYENV}#delaymq-env"
            --conf spark.pyspark.python=./delaymq-env/bin/python)
fi

"$spark_submit" \
    --name delaymq-backlog \
    --conf spark.sql.session.timeZone=UTC \
    --conf spark.ui.showConsoleProgress=false \
    --py-files "$work/delaymq.zip" \
    "${extra[@]}" \
    "${submit_args[@]}" \
    "$here/backlog_job.py" "$@"
