#!/usr/bin/env bash
# Create a Cloud TPU VM (a single host or a pod slice) for realm-jax.
#
# usage: tpu/create.sh [--spot] [--queued] [--dry-run] NAME ZONE ACCELERATOR_TYPE [RUNTIME_VERSION]
#   NAME              TPU VM name, e.g. realm-v4-32
#   ZONE              e.g. us-central2-b
#   ACCELERATOR_TYPE  e.g. v4-8, v4-32, v5litepod-16, v5p-32, v6e-8
#   RUNTIME_VERSION   TPU software version; default chosen from the accelerator type
#   --spot            spot (preemptible) capacity; the trainer saves a checkpoint on SIGTERM
#   --queued          request through queued resources (waits for capacity instead of failing)
#   --dry-run         print the gcloud command instead of running it
# The project comes from `gcloud config get project` (or CLOUDSDK_CORE_PROJECT).
# Next: tpu/setup.sh NAME ZONE
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; exit 2; }
die() { echo "tpu/create.sh: error: $*" >&2; echo "run tpu/create.sh --help for usage" >&2; exit 2; }

spot=() queued=0 dry_run=0 pos=()
for arg in "$@"; do
  case "$arg" in
    -h|--help) usage ;;
    --spot) spot=(--spot) ;;
    --queued) queued=1 ;;
    --dry-run) dry_run=1 ;;
    -*) die "unknown option $arg" ;;
    *) pos+=("$arg") ;;
  esac
done
if (( ${#pos[@]} < 3 || ${#pos[@]} > 4 )); then
  die "expected NAME ZONE ACCELERATOR_TYPE [RUNTIME_VERSION], got ${#pos[@]} argument(s)"
fi
name=${pos[0]} zone=${pos[1]} accel=${pos[2]} version=${pos[3]:-}
[[ "$accel" =~ ^v[0-9]+[a-z]*(litepod)?-[0-9]+$ ]] \
  || die "ACCELERATOR_TYPE '$accel' does not look like v4-8, v5litepod-16, v5p-32, v6e-8"
if [[ -z "$version" ]]; then
  case "$accel" in
    v5litepod-*|v5e-*) version=v2-alpha-tpuv5-lite ;;
    v5p-*) version=v2-alpha-tpuv5 ;;
    v6e-*) version=v2-alpha-tpuv6e ;;
    *) version=tpu-ubuntu2204-base ;;
  esac
fi

if (( queued )); then
  cmd=(gcloud compute tpus queued-resources create "$name" --node-id="$name" --zone="$zone"
       --accelerator-type="$accel" --runtime-version="$version" "${spot[@]}")
else
  cmd=(gcloud compute tpus tpu-vm create "$name" --zone="$zone"
       --accelerator-type="$accel" --version="$version" "${spot[@]}")
fi
if (( dry_run )); then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
command -v gcloud >/dev/null || die "gcloud not found (install the Google Cloud SDK)"
"${cmd[@]}"
if (( queued )); then
  echo "queued: watch with 'gcloud compute tpus queued-resources describe $name --zone=$zone'"
  echo "(state ACTIVE means the TPU VM exists), then run tpu/setup.sh $name $zone"
else
  echo "created $name; next: tpu/setup.sh $name $zone"
fi
