#!/usr/bin/env bash
# Run a config file's sweep() on a TPU VM pod, one point after another.
#
# usage: tpu/sweep.sh [--dry-run] [--prepare] NAME ZONE WORKDIR_PREFIX CONFIG_FILE[:VARIANT] [--config.k=v ...]
#   NAME ZONE        the TPU VM (tpu/create.sh, tpu/setup.sh)
#   WORKDIR_PREFIX   gs://BUCKET/folder or a shared-filesystem folder; point P runs in
#                    WORKDIR_PREFIX/P
#   CONFIG_FILE      config with a sweep() function, relative to the repo root, e.g.
#                    configs/realm.py (validated against the small variant unless named)
#   --config.k=v     extra overrides applied to every point (before the point's own)
#   --prepare        prepare the data in each point's WORKDIR before training it (in the
#                    foreground: launch.sh --wait --prepare); needs --config.data.corpus=PATH
#                    when the config's corpus is the bundled sample
#   --dry-run        print the tpu/launch.sh command of every point instead of running them
# The points come from `python -m realm_jax.sweep CONFIG_FILE[:VARIANT]` (run locally with this
# repo's .venv or python3), which applies every point to the config first, so a misspelt key
# fails here and not an hour into the sweep. Each point is started with
# `tpu/launch.sh --wait --run P`, i.e. the next starts when the previous trainers exit.
# A point that ends with exit status 0 at train.steps gets WORKDIR_PREFIX/P/DONE, any other
# FAILED (JSON: step, metrics, wall time); points whose DONE exists are skipped, so a sweep can
# be re-run after a failure. The markers are read and written here through realm_jax.fs
# (`python -m realm_jax.sweep.markers`, with the same python), so a gs:// prefix needs no
# mount; a shared-filesystem prefix gets them only where it is mounted on this machine too.
# Set LAUNCH_FLAGS (e.g. "--no-refresh") for launch.sh.
# `python -m realm_jax sweep --tpu NAME ZONE --config CONFIG --workdir WORKDIR_PREFIX` runs this
# script (and records the points in WORKDIR_PREFIX/sweep.json: gs://, or mounted locally);
# `python -m realm_jax sweep --table WORKDIR_PREFIX` then tables the finished points.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; exit 2; }
die() { echo "tpu/sweep.sh: error: $* (tpu/sweep.sh --help for usage)" >&2; exit 2; }

dry_run=0 prepare=() pos=() extra=()
while (( $# )); do
  case "$1" in
    -h|--help) usage ;;
    --dry-run) dry_run=1 ;;
    --prepare) prepare=(--prepare) ;;
    --config.*=*) extra+=("$1") ;;
    -*) die "unknown option $1" ;;
    *) pos+=("$1") ;;
  esac
  shift
done
(( ${#pos[@]} == 4 )) || die "expected NAME ZONE WORKDIR_PREFIX CONFIG_FILE, got ${#pos[@]} argument(s)"
name=${pos[0]} zone=${pos[1]} prefix=${pos[2]%/} config=${pos[3]}
[[ "$prefix" == /* || "$prefix" =~ ^gs://[a-z0-9][-a-z0-9_.]*[a-z0-9](/|$) ]] ||
  die "WORKDIR_PREFIX must be gs://BUCKET/... or an absolute path on a shared filesystem"
repo_root=$(cd "$(dirname "$0")/.." && pwd)
config_file=${config%%:*}
[[ "$config_file" != /* ]] || die "CONFIG_FILE must be relative to the repo root (as on the workers)"
[[ -f "$repo_root/$config_file" ]] || die "config file not found: $repo_root/$config_file"
python=${PYTHON:-}
if [[ -z "$python" ]]; then
  if [[ -x "$repo_root/.venv/bin/python" ]]; then python=$repo_root/.venv/bin/python; else python=python3; fi
fi
read -r -a launch_flags <<< "${LAUNCH_FLAGS:-}"
marker() {  # marker done|finish WORKDIR [...]: a point's DONE/FAILED, local or gs:// (fs.py)
  (cd "$repo_root" && PYTHONPATH="$repo_root${PYTHONPATH:+:$PYTHONPATH}" \
    "$python" -m realm_jax.sweep.markers "$@" </dev/null)
}

# NAME<TAB>--config.a=b --config.c=d, one line per point (fails on a bad point).
points=$(cd "$repo_root" && PYTHONPATH="$repo_root${PYTHONPATH:+:$PYTHONPATH}" \
  "$python" -m realm_jax.sweep "$config") || die "the sweep in $config does not validate"
[[ -n "$points" ]] || die "the sweep in $config has no points"
variant_spec=$config
[[ "$config" == *:* ]] || variant_spec="$config:small"  # realm_jax.sweep's default variant
if (( ${#extra[@]} || ${#prepare[@]} )); then  # the common overrides must apply too
  corpus=$(cd "$repo_root" && PYTHONPATH="$repo_root${PYTHONPATH:+:$PYTHONPATH}" "$python" -c '
import sys
from realm_jax.config import ConfigError, load_config
try:
    c = load_config(sys.argv[1], [o.removeprefix("--config.") for o in sys.argv[2:]])
except ConfigError as e:
    sys.exit(f"tpu/sweep.sh: {e}")
print(c.data.get("corpus", ""))' "$variant_spec" "${extra[@]}") || die "bad --config override"
  named=0
  for o in "${extra[@]}"; do [[ "$o" != --config.data.corpus=* ]] || named=1; done
  if (( ${#prepare[@]} && ! named )) && [[ -z "$corpus" || "$corpus" == data/sample/* ]]; then
    die "--prepare needs your corpus: add --config.data.corpus=gs://BUCKET/corpus.jsonl (the config's is the bundled 408-passage sample)"
  fi
fi

n=$(wc -l <<< "$points") i=0 failed=()
while IFS=$'\t' read -r point overrides_line; do
  i=$((i + 1))
  read -r -a overrides <<< "$overrides_line"
  workdir="$prefix/$point"
  cmd=("$repo_root/tpu/launch.sh" --wait --run "$point" "${prepare[@]}" "${launch_flags[@]}"
       "$name" "$zone" "$workdir" "$variant_spec" "${extra[@]}" "${overrides[@]}")
  if (( dry_run )); then
    printf '%q ' "${cmd[@]}"; echo
    continue
  fi
  echo "=== sweep point $i/$n: $point"
  seen=0  # 0: DONE exists, 3: it does not, else an error (realm_jax/sweep/markers.py)
  marker "done" "$workdir" || seen=$?
  if (( seen == 0 )); then
    echo "skipping $point: $workdir/DONE exists"
    continue
  elif (( seen != 3 )); then  # e.g. the bucket is unreachable: so would the run's workdir be
    echo "tpu/sweep.sh: error: cannot tell whether $point is done (above)" >&2
    exit 2
  fi
  start=$SECONDS rc=0
  "${cmd[@]}" </dev/null || rc=$?
  ended=0  # 0: DONE written, 3: FAILED written, else no marker
  marker finish "$workdir" --name "$point" --returncode "$rc" --wall_s $((SECONDS - start)) ||
    ended=$?
  if (( ended != 0 && ended != 3 )); then
    echo "tpu/sweep.sh: warning: no DONE/FAILED marker for $point (above): a re-run runs it again" >&2
    ended=$(( rc == 0 ? 0 : 3 ))
  fi
  if (( ended == 3 )); then
    echo "sweep point $point did not finish (exit status $rc); continuing with the next" >&2
    failed+=("$point")
  fi
done <<< "$points"
if (( ${#failed[@]} )); then
  echo "failed points: ${failed[*]}" >&2
  exit 1
fi
