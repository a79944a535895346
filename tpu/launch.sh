#!/usr/bin/env bash
# Start REALM pre-training on every worker of a TPU VM pod, plus the index refresh job.
#
# usage: tpu/launch.sh [options] NAME ZONE WORKDIR CONFIG_SPEC [--config.k=v ...]
#   NAME ZONE      the TPU VM (tpu/create.sh, tpu/setup.sh)
#   WORKDIR        run directory seen by EVERY worker: gs://BUCKET/FOLDER (no mount needed),
#                  or an absolute path on a shared filesystem mounted at the same path on
#                  every worker (Filestore NFS). Checkpoints, the published index, the prepared
#                  data and TensorBoard files live here.
#   CONFIG_SPEC    config file and variant relative to the repo, e.g. configs/realm.py:base
#   --config.k=v   config overrides, passed to every process (the refresher ignores mesh.shape)
# options:
#   --run RUN      name for the log folder ~/realm-jax/logs/RUN/ (default: basename of WORKDIR)
#   --prepare      first run `realm_jax prepare` on worker 0 (CPU) and wait for it
#   --no-refresh   start no refresh job (automatic with --config.refresh.mode=inprocess, and
#                  for an ICT or QA fine-tuning config: neither reads a refreshed index)
#   --wait         run the trainers in the foreground, then stop the refresher (tpu/sweep.sh)
#   --stop         send SIGTERM to this run's trainers and refresher (trainers checkpoint first)
#   --dry-run      print the gcloud commands instead of running them
# Every worker runs one `python -m realm_jax train --multihost` process (jax.distributed
# auto-detects the pod) with nohup, logging to ~/realm-jax/logs/RUN/train-w<worker>.log.
# Worker 0 also runs `python -m realm_jax refresh` (log: refresh.log). The refresher shares
# WORKDIR with the trainers: it reads their checkpoints and publishes WORKDIR/index, which every
# trainer host loads, hence a bucket or a shared filesystem. The trainer holds the host's TPU chips, so
# the refresher runs on the host CPU (JAX_PLATFORMS=cpu, override with REFRESH_PLATFORMS);
# for paper-scale corpora use --config.refresh.mode=inprocess instead (see tpu/README.md).
# Whether a refresher is needed is read from the config (config.task realm, refresh.mode
# external) with this repo's .venv/bin/python, $PYTHON or python3, as tpu/sweep.sh does.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; exit 2; }
die() { echo "tpu/launch.sh: error: $*" >&2; echo "run tpu/launch.sh --help for usage" >&2; exit 2; }

REMOTE_DIR='~/realm-jax'  # where tpu/setup.sh installed the repo (expanded remotely)
WORKER_ID='$(curl -sf -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || hostname)'
REFRESH_PLATFORMS=${REFRESH_PLATFORMS:-cpu}

run_name='' prepare=0 refresh=1 wait=0 stop=0 dry_run=0 pos=() overrides=()
while (( $# )); do
  case "$1" in
    -h|--help) usage ;;
    --run) (( $# >= 2 )) || die "--run needs a name"; run_name=$2; shift ;;
    --prepare) prepare=1 ;;
    --no-refresh) refresh=0 ;;
    --wait) wait=1 ;;
    --stop) stop=1 ;;
    --dry-run) dry_run=1 ;;
    --config.*=*) overrides+=("$1") ;;
    --config.*) die "override '$1' must be --config.section.field=value" ;;
    -*) die "unknown option $1" ;;
    *) pos+=("$1") ;;
  esac
  shift
done
(( ${#pos[@]} == 4 )) || die "expected NAME ZONE WORKDIR CONFIG_SPEC, got ${#pos[@]} argument(s)"
name=${pos[0]} zone=${pos[1]} workdir=${pos[2]} spec=${pos[3]}
workdir=${workdir%/}
if [[ "$workdir" == gs://* ]]; then
  # Read and written by every worker through the GCS API (orbax, TFDS, TensorBoard and the
  # index all take gs:// URLs): no gcsfuse mount needed.
  [[ "$workdir" =~ ^gs://[a-z0-9][-a-z0-9_.]*[a-z0-9]/[^[:space:]]+$ ]] ||
    die "WORKDIR must be gs://BUCKET/FOLDER (a folder inside the bucket), got $workdir"
else
  [[ "$workdir" == /* ]] ||
    die "WORKDIR must be gs://BUCKET/FOLDER or an absolute path on a shared filesystem, got $workdir"
fi
[[ "$spec" == *.py || "$spec" == *.py:* ]] || die "CONFIG_SPEC must be like configs/realm.py:base"
run_name=${run_name:-$(basename "$workdir")}
[[ "$run_name" =~ ^[A-Za-z0-9_.,=+-]+$ ]] || die "run name '$run_name' has unsafe characters"
for o in "${overrides[@]}"; do
  [[ "$o" != --config.refresh.mode=inprocess ]] || refresh=0
done
if (( refresh && ! stop )); then
  # Only REALM pre-training with an external refresh job reads the refresher's index: ICT
  # trains without one, QA fine-tuning (finetune, task qa) keeps its index frozen.
  repo_root=$(cd "$(dirname "$0")/.." && pwd)
  python=${PYTHON:-}
  if [[ -z "$python" ]]; then
    if [[ -x "$repo_root/.venv/bin/python" ]]; then python=$repo_root/.venv/bin/python; else python=python3; fi
  fi
  needs=$(cd "$repo_root" && PYTHONPATH="$repo_root${PYTHONPATH:+:$PYTHONPATH}" "$python" -c '
import sys
from realm_jax.config import ConfigError, load_config
try:
    c = load_config(sys.argv[1], [o.removeprefix("--config.") for o in sys.argv[2:]])
except ConfigError as e:
    print(f"tpu/launch.sh: error: {e}", file=sys.stderr)
    sys.exit(2)
print("refresh" if c.task == "realm" and c.refresh.mode == "external" else f"none {c.task}")' \
    "$spec" "${overrides[@]}") || {
    (( $? != 2 )) || exit 2  # a bad config or override, named above
    die "cannot read the config $spec with $python (pass --no-refresh to start no refresher)"
  }
  if [[ "$needs" != refresh ]]; then
    refresh=0
    echo "no refresher: config task ${needs#none } reads no refreshed index"
  fi
fi
logs="$REMOTE_DIR/logs/$run_name"

run() {
  if (( dry_run )); then printf '%q ' "$@"; echo; else "$@"; fi
}
on() {  # on WORKER COMMAND: run a bash command line on one worker (or all)
  run gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" --worker="$1" --command="$2"
}
(( dry_run )) || command -v gcloud >/dev/null || die "gcloud not found (install the Google Cloud SDK)"

stop_cmd() {  # stop_cmd GLOB: SIGTERM the processes whose pid files match GLOB (by pid)
  echo "for f in $logs/$1; do [ -f \"\$f\" ] || continue; p=\$(cat \"\$f\");
    kill -TERM \"\$p\" 2>/dev/null && echo \"\$(hostname): stopped \$p (\$f)\"; rm -f \"\$f\"; done; true"
}
if (( stop )); then
  on all "$(stop_cmd 'train-w*.pid')"
  on 0 "$(stop_cmd refresh.pid)"
  exit 0
fi

cli_args() {  # cli_args COMMAND [extra...]: the quoted realm_jax command line
  local command=$1 o
  local -a pass=()
  for o in "${overrides[@]}"; do
    # The pod's mesh shape does not fit the refresher's host CPU devices: let it use its own.
    [[ "$command" == refresh && "$o" == --config.mesh.shape=* ]] || pass+=("$o")
  done
  printf '%q ' .venv/bin/python -m realm_jax "$command" --config "$spec" --workdir "$workdir" \
    "${@:2}" "${pass[@]}"
}

if (( prepare )); then
  echo "preparing data in $workdir on worker 0"
  on 0 "cd $REMOTE_DIR && JAX_PLATFORMS=cpu $(cli_args prepare)"
fi

if (( refresh )); then
  echo "starting the refresher on worker 0 (log $logs/refresh.log)"
  on 0 "cd $REMOTE_DIR && mkdir -p $logs && JAX_PLATFORMS=$(printf '%q' "$REFRESH_PLATFORMS") \
    setsid nohup $(cli_args refresh) > $logs/refresh.log 2>&1 < /dev/null &
    echo \$! > $logs/refresh.pid; echo \"\$(hostname): refresh pid \$!\""
fi

train="cd $REMOTE_DIR && mkdir -p $logs && W=$WORKER_ID && log=$logs/train-w\$W.log"
if (( wait )); then
  echo "training on all workers (foreground; logs $logs/train-w*.log)"
  set +e
  on all "$train && echo \$\$ > $logs/train-w\$W.pid && exec $(cli_args train --multihost) \
    > \$log 2>&1 < /dev/null"
  rc=$?
  set -e
  (( ! refresh )) || on 0 "$(stop_cmd refresh.pid)"
  echo "training finished (exit status $rc)"
  exit "$rc"
fi
on all "$train && setsid nohup $(cli_args train --multihost) > \$log 2>&1 < /dev/null &
  echo \$! > $logs/train-w\$W.pid; echo \"\$(hostname): train pid \$!, log \$log\""
echo "launched run $run_name on $name. Watch: gcloud compute tpus tpu-vm ssh $name --zone=$zone \
--worker=0 --command='tail -f $logs/train-w0.log'"
echo "stop: tpu/launch.sh --stop --run $run_name $name $zone $workdir $spec"
