#!/usr/bin/env bash
# Run a config file's sweep() as an Optuna study on Cloud TPU VM slices, one worker per slice.
#
# usage: tpu/sweep.sh [--dry-run] --storage URL [--trials N] [--study NAME]
#                     PREFIX CONFIG_FILE[:VARIANT] NAME:ZONE[,NAME:ZONE...] [--config.k=v ...]
#   --storage URL    the study's database. The trainers on the TPU VMs report each held-out
#                    evaluation to it, so it must be a server this machine and every slice reach:
#                    postgresql://USER:PASSWORD@HOST/DB, mysql://USER:PASSWORD@HOST/DB, or
#                    grpc://HOST:PORT of Optuna's storage proxy in front of one
#                    (python -m realm_jax.sweep.proxy --storage postgresql://... --port 13000).
#                    Not SQLite (a file on this machine) and not localhost (each VM's own)
#   --trials N       a search's number of trials (default: the config's Search(trials=...);
#                    a grid runs its points and refuses it); trials finished in the study count
#   --study NAME     the study's name in the storage (default: sweep)
#   PREFIX           gs://BUCKET/FOLDER, or an absolute path that every worker of every slice
#                    mounts; a trial runs in PREFIX/<its params>
#   CONFIG_FILE      a config with a sweep() function, relative to the repo root (the same path
#                    on the workers), e.g. configs/realm.py:base
#   NAME:ZONE,...    the slices, each made by tpu/create.sh (or a queued resource that is
#                    ACTIVE) and installed by tpu/setup.sh; each must be READY
#   --config.k=v     overrides applied to every trial (before the trial's own parameters)
#   --dry-run        check the arguments, print the command, run nothing
# It checks the arguments and the slices, then runs here, in the foreground,
#   python -m realm_jax sweep --config CONFIG --workdir PREFIX --storage URL --tpu SLICES
#     --workers <number of slices> [--trials N] [--study NAME] [--config.k=v ...]
# with this repo's .venv/bin/python ($PYTHON or python3 without one): one Optuna worker per
# slice, each running its trials one after another on its slice with
#   tpu/launch.sh --wait --run TRIAL --env REALM_JAX_TRIAL=... NAME ZONE PREFIX/TRIAL CONFIG ...
# (REALM_JAX_TRIAL links the trainers to their trial: reports, pruning). Stopped (Ctrl-C: the
# running trials' trainers checkpoint and stop) or crashed, the same command resumes the study:
# finished trials are never repeated.
# The data must be prepared before: PREFIX/data (or --config.data.data_dir=FOLDER), e.g.
#   python -m realm_jax prepare --config CONFIG --workdir PREFIX --config.data.corpus=...
# with the same overrides (or tpu/launch.sh --prepare NAME ZONE PREFIX CONFIG ... on a slice).
# More workers from another machine: the same command there with other slices, the same
# --storage and --study (tpu/sweep.sh --storage URL --study NAME PREFIX CONFIG OTHER:ZONE).
# Queued resources: tpu/create.sh --queued NAME ZONE TYPE; once
# `gcloud compute tpus queued-resources describe NAME --zone=ZONE` says ACTIVE, the TPU VM NAME
# exists: tpu/setup.sh NAME ZONE, then name NAME:ZONE here (or add a worker on it as above).
# The table and plots: python -m realm_jax sweep --table PREFIX --storage URL --study NAME.
# This script prints a password in URL as ***; the trials' commands carry URL as it is, to
# the TPU VMs too: the gRPC proxy keeps the database's password on the proxy's machine.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; exit 2; }
die() { echo "tpu/sweep.sh: error: $* (tpu/sweep.sh --help for usage)" >&2; exit 2; }

dry_run=0 storage='' trials='' study='' pos=() overrides=()
while (( $# )); do
  case "$1" in
    -h|--help) usage ;;
    --dry-run) dry_run=1 ;;
    --storage|--trials|--study)
      (( $# >= 2 )) || die "$1 needs a value"
      case "$1" in
        --storage) storage=$2 ;;
        --trials) trials=$2 ;;
        --study) study=$2 ;;
      esac
      shift ;;
    --config.*=*) overrides+=("$1") ;;
    --config.*) die "override '$1' must be --config.section.field=value" ;;
    -*) die "unknown option $1" ;;
    *) pos+=("$1") ;;
  esac
  shift
done
(( ${#pos[@]} == 3 )) ||
  die "expected PREFIX CONFIG_FILE[:VARIANT] NAME:ZONE[,NAME:ZONE...], got ${#pos[@]} argument(s)"
prefix=${pos[0]%/} spec=${pos[1]} slices=${pos[2]}

# --- the storage: a server every TPU VM reaches
redact() { sed -E 's#(://[^/@:]*:)[^/@]*@#\1***@#' <<< "$1"; }
shown=$(redact "$storage")
[[ -n "$storage" ]] ||
  die "--storage is required: the trainers on the TPU VMs report to the study, so name a PostgreSQL/MySQL URL or grpc://HOST:PORT (python -m realm_jax.sweep.proxy)"
if [[ "$storage" == sqlite:* ]]; then
  die "--storage $shown is a file on this machine, out of the TPU VMs' reach: name a PostgreSQL/MySQL URL or grpc://HOST:PORT (python -m realm_jax.sweep.proxy)"
fi
if [[ "$storage" =~ ^grpc://([^/:@]+):([0-9]+)/?$ ]]; then
  host=${BASH_REMATCH[1]}
elif [[ "$storage" =~ ^(postgresql|postgres|mysql)(\+[a-z0-9_]+)?://([^/?]*)(/|$) ]]; then
  host=${BASH_REMATCH[3]##*@}  # drop USER:PASSWORD@
  host=${host%:*}              # and :PORT
  host=${host#[}; host=${host%]}
else
  die "--storage $shown must be postgresql://USER:PASSWORD@HOST/DB, mysql://... or grpc://HOST:PORT"
fi
case "$host" in
  '') die "--storage $shown names no host (a local socket): name a host every slice reaches" ;;
  localhost|127.*|::1|0.0.0.0)
    die "--storage $shown names $host, which on each TPU VM is the VM itself: name a host every slice reaches" ;;
esac
[[ -z "$trials" || "$trials" =~ ^[1-9][0-9]*$ ]] || die "--trials must be a positive whole number, got '$trials'"
[[ -z "$study" || "$study" =~ ^[A-Za-z0-9_.,=+-]+$ ]] ||
  die "--study '$study': use letters, digits and _.,=+- only"

# --- the prefix, the config, the slices
if [[ "$prefix" == gs://* ]]; then
  [[ "$prefix" =~ ^gs://[a-z0-9][-a-z0-9_.]*[a-z0-9]/[^[:space:]]+$ ]] ||
    die "PREFIX must be gs://BUCKET/FOLDER (a folder inside the bucket), got $prefix"
else
  [[ "$prefix" == /* ]] ||
    die "PREFIX must be gs://BUCKET/FOLDER or an absolute path every worker mounts, got $prefix"
fi
repo_root=$(cd "$(dirname "$0")/.." && pwd)
config_file=${spec%%:*}
[[ "$config_file" == *.py ]] || die "CONFIG_FILE must be like configs/realm.py[:VARIANT], got $spec"
[[ "$config_file" != /* ]] || die "CONFIG_FILE must be relative to the repo root (as on the workers)"
[[ -f "$repo_root/$config_file" ]] || die "config file not found: $repo_root/$config_file"
[[ -n "$slices" && "$slices" != *, && "$slices" != ,* && "$slices" != *,,* ]] ||
  die "slices '$slices' must be NAME:ZONE[,NAME:ZONE...] with no empty entry"
names=() zones=()
IFS=, read -r -a parts <<< "$slices"
for part in "${parts[@]}"; do
  [[ "$part" =~ ^([a-z]([-a-z0-9]*[a-z0-9])?):([a-z]+-[a-z]+[0-9]+-[a-z])$ ]] ||
    die "slice '$part' must be NAME:ZONE, e.g. realm-v4:us-central2-b"
  name=${BASH_REMATCH[1]} zone=${BASH_REMATCH[3]}
  for n in "${names[@]}"; do [[ "$n" != "$name" ]] || die "slice $name is named twice"; done
  names+=("$name") zones+=("$zone")
done

python=${PYTHON:-}
if [[ -z "$python" ]]; then
  if [[ -x "$repo_root/.venv/bin/python" ]]; then python=$repo_root/.venv/bin/python; else python=python3; fi
fi
cmd=("$python" -m realm_jax sweep --config "$spec" --workdir "$prefix" --storage "$storage"
     --tpu "$slices" --workers "${#names[@]}")
[[ -z "$trials" ]] || cmd+=(--trials "$trials")
[[ -z "$study" ]] || cmd+=(--study "$study")
cmd+=("${overrides[@]}")
shown_cmd() { redact "$(printf '%q ' "$@")"; }
if (( dry_run )); then
  shown_cmd "${cmd[@]}"
  exit 0
fi

# --- every slice exists and is READY (a queued resource not yet ACTIVE has no TPU VM yet)
command -v gcloud >/dev/null || die "gcloud not found (install the Google Cloud SDK)"
for i in "${!names[@]}"; do
  name=${names[i]} zone=${zones[i]}
  state=$(gcloud compute tpus tpu-vm describe "$name" --zone="$zone" --format='value(state)' \
    2>/dev/null </dev/null) ||
    die "no TPU VM $name in $zone (a queued resource? wait until gcloud compute tpus queued-resources describe $name --zone=$zone says ACTIVE, then tpu/setup.sh $name $zone)"
  [[ "$state" == READY ]] || die "TPU VM $name in $zone is ${state:-in no state}, not READY"
done

again=(tpu/sweep.sh --storage "$storage" ${trials:+--trials "$trials"} --study "${study:-sweep}"
       "$prefix" "$spec" OTHER_NAME:ZONE "${overrides[@]}")
echo "sweep of $spec in $prefix: ${#names[@]} worker(s), one per slice (${names[*]}), study ${study:-sweep} in $shown"
echo "add workers from another machine: $(shown_cmd "${again[@]}")"
echo "the table and plots: $(shown_cmd python -m realm_jax sweep --table "$prefix" --storage "$storage" --study "${study:-sweep}")"
cd "$repo_root"
export PYTHONPATH="$repo_root${PYTHONPATH:+:$PYTHONPATH}"
exec "${cmd[@]}"
