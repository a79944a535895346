#!/usr/bin/env bash
# Install realm-jax on every worker of a TPU VM (pod slice): code, .venv, TPU JAX.
#
# usage: tpu/setup.sh [--clone GIT_URL [--ref REF]] [--dry-run] NAME ZONE
#   NAME ZONE         the TPU VM made by tpu/create.sh
#   --clone GIT_URL   git clone the repo on each worker instead of copying this working tree
#   --ref REF         branch/tag/commit to check out with --clone (default: the remote's HEAD)
#   --dry-run         print the gcloud commands instead of running them
# By default the working tree (tracked + untracked, not git-ignored files; no .venv, no runs/)
# is copied with `gcloud compute tpus tpu-vm scp --worker=all --recurse` to ~/realm-jax on
# every worker. Then on every worker: python3.11 .venv, `pip install -r requirements.txt`,
# `pip install "jax[tpu]==0.10.2"` (TPU JAX replaces the CPU pin), `pip install --no-deps -e .`.
# Re-running it updates the code and reuses the existing .venv.
# Next: tpu/launch.sh NAME ZONE WORKDIR CONFIG_SPEC [overrides...]
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; exit 2; }
die() { echo "tpu/setup.sh: error: $*" >&2; echo "run tpu/setup.sh --help for usage" >&2; exit 2; }

JAX_TPU='jax[tpu]==0.10.2'  # keep in step with the jax pin in requirements.txt
# shellcheck disable=SC2088  # expanded by the remote shell, on purpose
REMOTE_DIR='~/realm-jax'      # expanded by the remote shell

clone='' ref='' dry_run=0 pos=()
while (( $# )); do
  case "$1" in
    -h|--help) usage ;;
    --clone) (( $# >= 2 )) || die "--clone needs a GIT_URL"; clone=$2; shift ;;
    --ref) (( $# >= 2 )) || die "--ref needs a value"; ref=$2; shift ;;
    --dry-run) dry_run=1 ;;
    -*) die "unknown option $1" ;;
    *) pos+=("$1") ;;
  esac
  shift
done
(( ${#pos[@]} == 2 )) || die "expected NAME ZONE, got ${#pos[@]} argument(s)"
[[ -z "$ref" || -n "$clone" ]] || die "--ref only makes sense with --clone"
name=${pos[0]} zone=${pos[1]}
repo_root=$(cd "$(dirname "$0")/.." && pwd)

run() {
  if (( dry_run )); then printf '%q ' "$@"; echo; else "$@"; fi
}
on_all() {  # on_all COMMAND: run a bash command line on every worker
  run gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" --worker=all --command="$1"
}

(( dry_run )) || command -v gcloud >/dev/null || die "gcloud not found (install the Google Cloud SDK)"

# ---------------------------------------------------------------- code
if [[ -n "$clone" ]]; then
  if [[ -n "$ref" ]]; then
    update="git -C $REMOTE_DIR checkout -q $(printf '%q' "$ref")"
  else
    update="git -C $REMOTE_DIR pull -q --ff-only"
  fi
  on_all "set -e; if [ -d $REMOTE_DIR/.git ]; then git -C $REMOTE_DIR fetch -q --all;
    else git clone -q $(printf '%q' "$clone") $REMOTE_DIR; fi; $update"
else
  git -C "$repo_root" rev-parse --is-inside-work-tree >/dev/null 2>&1 \
    || die "$repo_root is not a git checkout; use --clone GIT_URL"
  stage=$(mktemp -d "${TMPDIR:-/tmp}/realm-jax-stage.XXXXXX")
  trap 'rm -rf "$stage"' EXIT
  mkdir "$stage/realm-jax"
  # Tracked and untracked-but-not-ignored files that exist (a deleted tracked file is skipped).
  (cd "$repo_root" && git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [[ -e "$f" ]] && printf '%s\0' "$f"; done \
    | tar --null -T - -cf -) | tar -xf - -C "$stage/realm-jax"
  echo "copying $(find "$stage/realm-jax" -type f | wc -l) files to $name:$REMOTE_DIR (all workers)"
  # Clear the old copy but keep its .venv, so that deleted files do not linger.
  on_all "mkdir -p $REMOTE_DIR && find $REMOTE_DIR -mindepth 1 -maxdepth 1 ! -name .venv \
    -exec rm -rf {} +"
  run gcloud compute tpus tpu-vm scp "$stage/realm-jax" "$name:~/" \
    --zone="$zone" --worker=all --recurse
fi

# ---------------------------------------------------------------- python environment
on_all "set -euo pipefail
if ! command -v python3.11 >/dev/null; then
  sudo apt-get update -qq && sudo apt-get install -y -qq python3.11 python3.11-venv
fi
cd $REMOTE_DIR
[ -x .venv/bin/python ] || python3.11 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements.txt
.venv/bin/python -m pip install -q '$JAX_TPU'
.venv/bin/python -m pip install -q --no-deps -e .
echo \"\$(hostname): jax \$(.venv/bin/python -c 'import jax; print(jax.__version__)') installed\""

echo "set up $name; next: tpu/launch.sh $name $zone WORKDIR CONFIG_SPEC [overrides...]"
