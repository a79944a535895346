#!/usr/bin/env bash
# The index refresh job on its own TPU VM slice, beside the training slice (the paper's way).
#
# usage: tpu/refresh_slice.sh [options] ACTION NAME ZONE [WORKDIR CONFIG_SPEC [--config.k=v ...]]
#   ACTION   create   create the refresh slice (tpu/create.sh with its accelerator type)
#            setup    install realm-jax on every worker of it (tpu/setup.sh, as for the trainer)
#            start    run `python -m realm_jax refresh --multihost` on every worker of it, detached
#                     (nohup; log ~/realm-jax/logs/RUN/refresh-w<worker>.log on each worker)
#            stop     SIGTERM that refresh job on every worker
#            delete   delete the refresh slice (it bills while it exists, running or not)
#   NAME ZONE      the TRAINING slice (tpu/create.sh): the refresh slice's name and zone
#                  default to NAME-refresh and ZONE
#   WORKDIR        (start, stop) the training run's gs://BUCKET/FOLDER: the refresh job reads
#                  the trainer's checkpoints there and publishes WORKDIR/index, which the trainers
#                  load; a shared-filesystem path only where both slices mount it
#   CONFIG_SPEC    (start, stop) the trainer's config, e.g. configs/realm.py:base
#   --config.k=v   (start) the trainer's overrides; mesh.shape is dropped (the refresh job shards
#                  the corpus over all of its own devices), refresh.mode is set to external
# options (each also from the environment):
#   --name NAME                REFRESH_TPU_NAME          the refresh slice (default NAME-refresh)
#   --zone ZONE                REFRESH_ZONE              its zone (default: the trainer's ZONE)
#   --accelerator-type TYPE    REFRESH_ACCELERATOR_TYPE  its accelerator type (default v4-8)
#   --runtime-version VERSION  REFRESH_RUNTIME_VERSION   (create) TPU software version (default:
#                                                        tpu/create.sh's for the type)
#   --spot, --queued           (create, delete) as tpu/create.sh
#   --clone GIT_URL, --ref REF (setup) as tpu/setup.sh
#   --run RUN                  log folder name (default: basename of WORKDIR, as tpu/launch.sh)
#   --dry-run                  print the gcloud commands instead of running them
#
# The paper (REALM, Guu et al. 2020) trains on 64 TPUs and parallelises the document embedding
# for the MIPS index over 16 other TPUs: that separate job re-embeds all 13,353,718 Wikipedia
# blocks from the trainer's newest checkpoint and publishes a new index about every 500 steps,
# asynchronously, while the trainer never waits for it (it keeps the index it has). This script
# gives realm-jax that arrangement: a second slice runs `realm_jax refresh` as one multi-host JAX
# job (jax.distributed over that slice's workers only), sharing nothing with the trainers but
# the WORKDIR. `tpu/launch.sh --refresh-slice` starts it together with the trainers (and
# --stop stops both); the trainers then start no refresher on worker 0 and run with
# refresh.mode=external, keeping their index until a newer one is published. Before the first
# index they wait while the job's WORKDIR/index/progress.json advances (refresh.wait_seconds
# without progress ends the wait).
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; exit 2; }
die() { echo "tpu/refresh_slice.sh: error: $* (tpu/refresh_slice.sh --help for usage)" >&2; exit 2; }
# shellcheck source=tpu/checks.sh
source "$(dirname "${BASH_SOURCE[0]}")/checks.sh"

# shellcheck disable=SC2088  # expanded by the remote shell, on purpose
REMOTE_DIR='~/realm-jax'  # where tpu/setup.sh installs the repo (expanded remotely)
# shellcheck disable=SC2016  # expanded on each worker, on purpose
WORKER_ID='$(curl -sf -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || hostname)'

rname=${REFRESH_TPU_NAME:-} rzone=${REFRESH_ZONE:-} accel=${REFRESH_ACCELERATOR_TYPE:-v4-8}
version=${REFRESH_RUNTIME_VERSION:-}
run_name='' dry_run=0 spot=() queued=() clone=() pos=() overrides=()
while (( $# )); do
  case "$1" in
    -h|--help) usage ;;
    --name) (( $# >= 2 )) || die "--name needs a value"; rname=$2; shift ;;
    --zone) (( $# >= 2 )) || die "--zone needs a value"; rzone=$2; shift ;;
    --accelerator-type) (( $# >= 2 )) || die "--accelerator-type needs a value"; accel=$2; shift ;;
    --runtime-version) (( $# >= 2 )) || die "--runtime-version needs a value"; version=$2; shift ;;
    --spot) spot=(--spot) ;;
    --queued) queued=(--queued) ;;
    --clone|--ref) (( $# >= 2 )) || die "$1 needs a value"; clone+=("$1" "$2"); shift ;;
    --run) (( $# >= 2 )) || die "--run needs a name"; run_name=$2; shift ;;
    --dry-run) dry_run=1 ;;
    --config.*=*) overrides+=("$1") ;;
    --config.*) die "override '$1' must be --config.section.field=value" ;;
    -*) die "unknown option $1" ;;
    *) pos+=("$1") ;;
  esac
  shift
done
(( ${#pos[@]} >= 1 )) || die "expected ACTION NAME ZONE [WORKDIR CONFIG_SPEC]"
action=${pos[0]}
case "$action" in
  create|setup|delete)
    (( ${#pos[@]} == 3 )) || die "$action expects NAME ZONE, got $(( ${#pos[@]} - 1 )) argument(s)"
    (( ${#overrides[@]} == 0 )) || die "$action takes no --config overrides" ;;
  start|stop)
    (( ${#pos[@]} == 5 )) ||
      die "$action expects NAME ZONE WORKDIR CONFIG_SPEC, got $(( ${#pos[@]} - 1 )) argument(s)" ;;
  *) die "unknown ACTION '$action' (create, setup, start, stop or delete)" ;;
esac
name=${pos[1]} zone=${pos[2]}
rname=${rname:-$name-refresh}
rzone=${rzone:-$zone}
[[ "$rname" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] ||
  die "refresh slice name '$rname' must be lower-case letters, digits and -"
[[ "$rname" != "$name" ]] || die "the refresh slice must not be the training slice ($name)"
[[ "$accel" =~ ^v[0-9]+[a-z]*(litepod)?-[0-9]+$ ]] ||
  die "accelerator type '$accel' does not look like v4-8, v5litepod-8, v5p-8, v6e-8"
here=$(cd "$(dirname "$0")" && pwd)
dry=()
(( ! dry_run )) || dry=(--dry-run)

run() {
  if (( dry_run )); then printf '%q ' "$@"; echo; else "$@"; fi
}
on_all() {  # on_all COMMAND: run a bash command line on every worker of the refresh slice
  run gcloud compute tpus tpu-vm ssh "$rname" --zone="$rzone" --worker=all --command="$1"
}

case "$action" in
  create)
    echo "creating the refresh slice $rname ($accel in $rzone)"
    exec bash "$here/create.sh" "${dry[@]}" "${spot[@]}" "${queued[@]}" \
      "$rname" "$rzone" "$accel" ${version:+"$version"} ;;
  setup)
    exec bash "$here/setup.sh" "${dry[@]}" "${clone[@]}" "$rname" "$rzone" ;;
  delete)
    (( dry_run )) || command -v gcloud >/dev/null || die "gcloud not found (install the Google Cloud SDK)"
    if (( ${#queued[@]} )); then
      run gcloud compute tpus queued-resources delete "$rname" --zone="$rzone" --force --quiet
    else
      run gcloud compute tpus tpu-vm delete "$rname" --zone="$rzone" --quiet
    fi
    echo "deleted the refresh slice $rname"
    exit 0 ;;
esac

# ---------------------------------------------------------------- start / stop
workdir=${pos[3]%/} spec=${pos[4]}
check_workdir_and_spec "$workdir" "$spec"
run_name=${run_name:-$(basename "$workdir")}
check_run_name "$run_name"
logs="$REMOTE_DIR/logs/$run_name"
(( dry_run )) || command -v gcloud >/dev/null || die "gcloud not found (install the Google Cloud SDK)"

if [[ "$action" == stop ]]; then
  on_all "for f in $logs/refresh-w*.pid; do [ -f \"\$f\" ] || continue; p=\$(cat \"\$f\");
    kill -TERM \"\$p\" 2>/dev/null && echo \"\$(hostname): stopped \$p (\$f)\"; rm -f \"\$f\"; done; true"
  exit 0
fi

pass=()
for o in "${overrides[@]}"; do
  case "$o" in
    --config.mesh.shape=*) ;;  # the trainer's mesh does not fit this slice: all devices on 'data'
    --config.refresh.mode=*)
      [[ "$o" == --config.refresh.mode=external ]] ||
        die "$o: a refresh slice serves refresh.mode=external (the trainer re-embeds itself otherwise)" ;;
    *) pass+=("$o") ;;
  esac
done
cmd=$(printf '%q ' .venv/bin/python -m realm_jax refresh --config "$spec" --workdir "$workdir" \
  --multihost "${pass[@]}" --config.refresh.mode=external)
echo "starting the refresh job on every worker of $rname (logs $logs/refresh-w*.log there)"
# only the command in the background (tpu/launch.sh says why), so that ssh returns at once
on_all "cd $REMOTE_DIR && mkdir -p $logs && W=$WORKER_ID && log=$logs/refresh-w\$W.log && {
  setsid nohup $cmd > \$log 2>&1 < /dev/null &
  echo \$! > $logs/refresh-w\$W.pid; echo \"\$(hostname): refresh pid \$!, log \$log\"; }"
echo "watch: gcloud compute tpus tpu-vm ssh $rname --zone=$rzone --worker=0 \
--command='tail -f $logs/refresh-w0.log'; the index's progress: $workdir/index/progress.json"
