# shellcheck shell=bash
# Shared argument checks of tpu/launch.sh and tpu/refresh_slice.sh (sourced; each defines die).

# check_workdir_and_spec WORKDIR SPEC: a gs://BUCKET/FOLDER or an absolute path on a
# filesystem every worker mounts, and a config spec like configs/realm.py:base.
check_workdir_and_spec() {
  local workdir=$1 spec=$2
  if [[ "$workdir" == gs://* ]]; then
    # Read and written by every worker through the GCS API (orbax, TFDS, TensorBoard and
    # the index all take gs:// URLs): no gcsfuse mount needed.
    [[ "$workdir" =~ ^gs://[a-z0-9][-a-z0-9_.]*[a-z0-9]/[^[:space:]]+$ ]] ||
      die "WORKDIR must be gs://BUCKET/FOLDER (a folder inside the bucket), got $workdir"
  else
    [[ "$workdir" == /* ]] ||
      die "WORKDIR must be gs://BUCKET/FOLDER or an absolute path on a filesystem every worker mounts, got $workdir"
  fi
  [[ "$spec" == *.py || "$spec" == *.py:* ]] || die "CONFIG_SPEC must be like configs/realm.py:base"
}

# check_run_name NAME: safe in file names and remote shell words.
check_run_name() {
  [[ "$1" =~ ^[A-Za-z0-9_.,=+-]+$ ]] || die "run name '$1' has unsafe characters"
}
