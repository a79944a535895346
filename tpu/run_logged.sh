#!/usr/bin/env bash
# Run a command with its output in a local log file that is also copied to a gs:// URL.
#
# usage: tpu/run_logged.sh [--every SECONDS] LOG LOG_URL -- COMMAND [ARG...]
#   LOG        local file for COMMAND's stdout and stderr (its folder is made)
#   LOG_URL    where LOG is copied: gs://BUCKET/... or a path (a shared filesystem)
#   --every    seconds between copies while COMMAND runs (default 60)
# Runs on a TPU VM worker from the repo root (tpu/launch.sh --prepare starts it there under
# `setsid nohup`, so that it outlives the ssh session). LOG is copied to LOG_URL every SECONDS
# and once more when COMMAND ends, after a last line `exit status N`; the exit status is
# COMMAND's. SIGTERM or SIGINT is passed on to COMMAND. Copies go through realm_jax.fs (gcsfs,
# the worker's service account) with $PYTHON (default .venv/bin/python); an object store has no
# append, so each copy replaces the object with the whole log so far. A copy that fails is
# noted once in LOG and retried at the next.
set -uo pipefail

die() { echo "tpu/run_logged.sh: error: $*" >&2; exit 2; }
every=60
if [[ "${1:-}" == --every ]]; then
  [[ "${2:-}" =~ ^[0-9]+$ ]] || die "--every needs whole seconds"
  every=$2; shift 2
fi
if (( $# < 4 )) || [[ "$3" != -- ]]; then
  die "usage: tpu/run_logged.sh [--every SECONDS] LOG LOG_URL -- COMMAND [ARG...]"
fi
log=$1 url=$2
shift 3
python=${PYTHON:-.venv/bin/python}
mkdir -p "$(dirname "$log")" || die "cannot make the folder of $log"

noted=0
copy() {
  local err
  if ! err=$("$python" -c '
import sys
from realm_jax import fs
fs.makedirs(fs.dirname(sys.argv[2]))
with open(sys.argv[1], "rb") as f:
    fs.write_bytes(sys.argv[2], f.read())
' "$log" "$url" 2>&1); then
    if (( ! noted )); then
      echo "tpu/run_logged.sh: copying this log to $url failed (retried every ${every}s): ${err##*$'\n'}" >> "$log"
      noted=1
    fi
  fi
}

: > "$log" || die "cannot write $log"
"$@" >> "$log" 2>&1 < /dev/null &  # appending, as the notes below do
child=$!
trap 'kill -TERM "$child" 2>/dev/null' TERM INT
last=$SECONDS
while kill -0 "$child" 2>/dev/null; do
  sleep 1 & wait $!
  if (( SECONDS - last >= every )); then
    copy
    last=$SECONDS
  fi
done
wait "$child"
rc=$?
echo "exit status $rc" >> "$log"
copy
exit "$rc"
