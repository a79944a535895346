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
#   --prepare      prepare the data only: `realm_jax prepare` into WORKDIR/data (or
#                  data.data_dir) from YOUR corpus, named by --config.data.corpus=PATH (gs://
#                  or a path on worker 0; required when the config's corpus is the bundled
#                  408-passage sample: name that explicitly to prepare it), and a separate
#                  pre-training text by --config.data.sentences=PATH. Runs detached on worker 0
#                  (setsid nohup, CPU), its log copied to WORKDIR/logs/prepare.log every minute
#                  and at the end (last line `exit status N`); returns at once with the commands
#                  to follow it. Start training afterwards with the same command without
#                  --prepare. With --wait it runs in the foreground, then trains.
#                  PREPARE_FLAGS adds prepare flags (e.g. --overwrite)
#   --runner R     with --prepare: local (default: on worker 0's cores, Beam's DirectRunner or
#                  in process as data.engine decides) or dataflow: Beam's DataflowRunner, its
#                  driver detached on worker 0, with --project DATAFLOW_PROJECT (default: gcloud's
#                  project), --region DATAFLOW_REGION (default: ZONE's region), --temp_location
#                  DATAFLOW_TEMP_LOCATION (default WORKDIR/dataflow/tmp), --staging_location
#                  (WORKDIR/dataflow/staging), and DATAFLOW_OPTIONS added as they are (e.g.
#                  "--machine_type=n2-standard-8 --max_num_workers=64"); needs gs:// WORKDIR and
#                  corpus (the Dataflow workers read and write them)
#   --refresh-slice  run the refresh job on its own TPU slice (tpu/refresh_slice.sh, which
#                  creates it; REFRESH_TPU_NAME, default NAME-refresh, REFRESH_ZONE, default
#                  ZONE): start it there on every worker, start none on worker 0, and train
#                  with refresh.mode=external; with --stop, stop it there too
#   --no-refresh   start no refresh job (automatic with --config.refresh.mode=inprocess or
#                  amortized, and for an ICT or QA fine-tuning config: neither reads a
#                  refreshed index)
#   --env NAME=VALUE  export NAME=VALUE in every trainer process on every worker (not in the
#                  refresher's, nor prepare's); repeatable. NAME is [A-Z_][A-Z0-9_]*, VALUE any
#                  text (quoted for the remote shell): the sweep passes each trial its link to
#                  the study this way (REALM_JAX_TRIAL, JSON)
#   --wait         run the trainers in the foreground, then stop the refresher (the sweep's
#                  trials: tpu/sweep.sh); SIGTERM or SIGINT to launch.sh then stops the
#                  trainers (and the refresher) as --stop does, and exits 143 once they ended
#   --stop         send SIGTERM to this run's trainers and refresher (trainers checkpoint first)
#   --dry-run      print the gcloud commands instead of running them
# Every worker runs one `python -m realm_jax train --multihost` process (jax.distributed
# auto-detects the pod) with nohup, logging to ~/realm-jax/logs/RUN/train-w<worker>.log.
# Without --refresh-slice, worker 0 also runs `python -m realm_jax refresh` (log: refresh.log).
# The refresher shares WORKDIR with the trainers: it reads their checkpoints and publishes
# WORKDIR/index, which every trainer host loads, hence a bucket or a shared filesystem. The
# trainer holds the host's TPU chips, so a refresher on worker 0 runs on the host CPU
# (JAX_PLATFORMS=cpu, override with REFRESH_PLATFORMS): enough for small corpora only; for
# paper-scale corpora use --refresh-slice or refresh.mode=amortized/inprocess (tpu/README.md).
# Whether a refresher is needed is read from the config (config.task realm, refresh.mode
# external) with this repo's .venv/bin/python, $PYTHON or python3, as tpu/sweep.sh does.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; exit 2; }
die() { echo "tpu/launch.sh: error: $* (tpu/launch.sh --help for usage)" >&2; exit 2; }
# shellcheck source=tpu/checks.sh
source "$(dirname "${BASH_SOURCE[0]}")/checks.sh"

# shellcheck disable=SC2088  # expanded by the remote shell, on purpose
REMOTE_DIR='~/realm-jax'  # where tpu/setup.sh installed the repo (expanded remotely)
# shellcheck disable=SC2016  # expanded on each worker, on purpose
WORKER_ID='$(curl -sf -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || hostname)'
REFRESH_PLATFORMS=${REFRESH_PLATFORMS:-cpu}

run_name='' prepare=0 runner='' refresh=1 slice=0 wait=0 stop=0 dry_run=0 pos=() overrides=()
exports=''  # `export NAME=VALUE && ` for each --env, quoted for the workers' shell
while (( $# )); do
  case "$1" in
    -h|--help) usage ;;
    --run) (( $# >= 2 )) || die "--run needs a name"; run_name=$2; shift ;;
    --prepare) prepare=1 ;;
    --runner) (( $# >= 2 )) || die "--runner needs local or dataflow"; runner=$2; shift ;;
    --refresh-slice) slice=1 ;;
    --no-refresh) refresh=0 ;;
    --env)
      (( $# >= 2 )) || die "--env needs NAME=VALUE"
      [[ "$2" == *=* && "${2%%=*}" =~ ^[A-Z_][A-Z0-9_]*$ ]] ||
        die "--env needs NAME=VALUE with NAME in [A-Z_][A-Z0-9_]*, got '${2%%=*}'"
      exports+="export ${2%%=*}=$(printf '%q' "${2#*=}") && "; shift ;;
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
check_workdir_and_spec "$workdir" "$spec"
run_name=${run_name:-$(basename "$workdir")}
check_run_name "$run_name"
[[ -z "$runner" || "$runner" == local || "$runner" == dataflow ]] ||
  die "--runner must be local or dataflow, got '$runner'"
[[ -z "$runner" ]] || (( prepare )) || die "--runner goes with --prepare"
(( ! (prepare && stop) )) || die "--prepare and --stop do not go together"
(( ! (slice && !refresh) )) || die "--refresh-slice and --no-refresh do not go together"
corpus='' mode=''
for o in "${overrides[@]}"; do
  case "$o" in
    --config.data.corpus=*) corpus=${o#*=} ;;
    --config.refresh.mode=*) mode=${o#*=} ;;
  esac
done
[[ -z "$mode" || "$mode" == external ]] || refresh=0  # the trainers re-embed the corpus
if (( slice )); then
  # The trainers keep their index and look for a newer one every refresh.check_every steps;
  # the refresh job on the other slice publishes it (tpu/refresh_slice.sh).
  [[ -z "$mode" || "$mode" == external ]] ||
    die "--refresh-slice needs refresh.mode=external, not --config.refresh.mode=$mode"
  [[ -n "$mode" ]] || overrides+=(--config.refresh.mode=external)
fi
if (( prepare )) && [[ "$runner" == dataflow ]]; then
  [[ "$workdir" == gs://* ]] || die "--runner dataflow needs a gs:// WORKDIR (Dataflow's workers write the data there)"
  [[ "$corpus" == gs://* ]] ||
    die "--runner dataflow needs --config.data.corpus=gs://... (Dataflow's workers read it)"
fi
if (( (refresh || prepare) && ! stop )); then
  # Only REALM pre-training with an external refresh job reads the refresher's index: ICT
  # trains without one, QA fine-tuning (finetune, task qa) keeps its index frozen. The
  # config's corpus tells --prepare whether the user named theirs.
  repo_root=$(cd "$(dirname "$0")/.." && pwd)
  python=${PYTHON:-}
  if [[ -z "$python" ]]; then
    if [[ -x "$repo_root/.venv/bin/python" ]]; then python=$repo_root/.venv/bin/python; else python=python3; fi
  fi
  read_config=$(cd "$repo_root" && PYTHONPATH="$repo_root${PYTHONPATH:+:$PYTHONPATH}" "$python" -c '
import sys
from realm_jax.config import ConfigError, load_config
try:
    c = load_config(sys.argv[1], [o.removeprefix("--config.") for o in sys.argv[2:]])
except ConfigError as e:
    print(f"tpu/launch.sh: error: {e}", file=sys.stderr)
    sys.exit(2)
print("refresh" if c.task == "realm" and c.refresh.mode == "external" else f"none {c.task}")
print(c.data.get("corpus", ""))' \
    "$spec" "${overrides[@]}") || {
    (( $? != 2 )) || exit 2  # a bad config or override, named above
    die "cannot read the config $spec with $python (pass --no-refresh to start no refresher)"
  }
  needs=${read_config%%$'\n'*}
  config_corpus=${read_config#*$'\n'}
  if (( prepare )) && [[ -z "$corpus" && ( -z "$config_corpus" || "$config_corpus" == data/sample/* ) ]]; then
    # One line, before anything starts: a pod must not silently prepare the bundled sample.
    die "--prepare needs your corpus: add --config.data.corpus=gs://BUCKET/corpus.jsonl (the config's data.corpus is the bundled 408-passage sample ${config_corpus:-?}; name it explicitly to prepare that)"
  fi
  if (( refresh )) && [[ "$needs" != refresh ]]; then
    (( ! slice )) || die "--refresh-slice: config task ${needs#none } reads no refreshed index"
    refresh=0
    echo "no refresher: config task ${needs#none } reads no refreshed index"
  fi
fi
logs="$REMOTE_DIR/logs/$run_name"
here=$(cd "$(dirname "$0")" && pwd)
slice_flag=''
(( ! slice )) || slice_flag='--refresh-slice '
dry=()
(( ! dry_run )) || dry=(--dry-run)

run() {
  if (( dry_run )); then printf '%q ' "$@"; echo; else "$@"; fi
}
on() {  # on WORKER COMMAND: run a bash command line on one worker (or all)
  run gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" --worker="$1" --command="$2"
}
(( dry_run )) || command -v gcloud >/dev/null || die "gcloud not found (install the Google Cloud SDK)"
refresh_slice() {  # refresh_slice start|stop: the refresh job on its own slice
  bash "$here/refresh_slice.sh" "${dry[@]}" --run "$run_name" "$1" "$name" "$zone" "$workdir" \
    "$spec" "${overrides[@]}"
}

stop_cmd() {  # stop_cmd GLOB: SIGTERM the processes whose pid files match GLOB (by pid)
  echo "for f in $logs/$1; do [ -f \"\$f\" ] || continue; p=\$(cat \"\$f\");
    kill -TERM \"\$p\" 2>/dev/null && echo \"\$(hostname): stopped \$p (\$f)\"; rm -f \"\$f\"; done; true"
}
if (( stop )); then
  on all "$(stop_cmd 'train-w*.pid')"
  if (( slice )); then refresh_slice stop; else on 0 "$(stop_cmd refresh.pid)"; fi
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
  extra=()
  read -r -a extra <<< "${PREPARE_FLAGS:-}"
  if [[ "$runner" == dataflow ]]; then
    project=${DATAFLOW_PROJECT:-${CLOUDSDK_CORE_PROJECT:-}}
    if [[ -z "$project" ]] && command -v gcloud >/dev/null; then
      project=$(gcloud config get-value project 2>/dev/null || true)
    fi
    [[ -n "$project" ]] || die "--runner dataflow: set DATAFLOW_PROJECT (or gcloud config set project PROJECT)"
    region=${DATAFLOW_REGION:-${zone%-*}}
    temp=${DATAFLOW_TEMP_LOCATION:-$workdir/dataflow/tmp}
    # The package and its requirements reach Dataflow's workers through these two files.
    options="--project=$project --region=$region --temp_location=$temp \
--staging_location=$workdir/dataflow/staging --setup_file=./pyproject.toml \
--requirements_file=requirements.txt${DATAFLOW_OPTIONS:+ $DATAFLOW_OPTIONS}"
    extra+=(--beam_runner=DataflowRunner "--beam_options=$options")
  fi
  prep="cd $REMOTE_DIR && mkdir -p $logs && export JAX_PLATFORMS=cpu &&"
  if (( wait )); then
    echo "preparing data in $workdir on worker 0 (foreground)"
    on 0 "$prep $(cli_args prepare "${extra[@]}")"
  else
    # Detached: the ssh session ends at once, the job goes on (and its log on WORKDIR), so
    # nothing waits on it while the pod bills; training is started once it has finished.
    log_url=$workdir/logs/prepare.log
    on 0 "$prep { setsid nohup bash tpu/run_logged.sh $logs/prepare.log $(printf '%q' "$log_url") -- \
      $(cli_args prepare "${extra[@]}") > /dev/null 2>&1 < /dev/null &
      echo \$! > $logs/prepare.pid; echo \"\$(hostname): prepare pid \$!, log $logs/prepare.log\"; }"
    echo "preparing data in $workdir on worker 0, detached${runner:+ ($runner)}."
    if [[ "$log_url" == gs://* ]]; then
      echo "its log, copied every minute (last line: exit status N): gcloud storage cat $log_url"
    else
      echo "its log, copied every minute (last line: exit status N): $log_url"
    fi
    echo "follow it live: gcloud compute tpus tpu-vm ssh $name --zone=$zone --worker=0 \
--command='tail -f $logs/prepare.log'"
    echo "then train: tpu/launch.sh ${slice_flag}$name $zone $workdir $spec [the same overrides]"
    exit 0
  fi
fi

if (( refresh )); then
  if (( slice )); then
    refresh_slice start
  else
    echo "starting the refresher on worker 0 (log $logs/refresh.log)"
    on 0 "cd $REMOTE_DIR && mkdir -p $logs && { JAX_PLATFORMS=$(printf '%q' "$REFRESH_PLATFORMS") \
      setsid nohup $(cli_args refresh) > $logs/refresh.log 2>&1 < /dev/null &
      echo \$! > $logs/refresh.pid; echo \"\$(hostname): refresh pid \$!\"; }"
  fi
fi
stop_refresher() {
  (( refresh )) || return 0
  if (( slice )); then refresh_slice stop; else on 0 "$(stop_cmd refresh.pid)"; fi
}
ssh_pid=''
stop_foreground() {  # --wait's SIGTERM/SIGINT: the trainers' ssh session is ssh_pid
  trap - TERM INT
  echo "stopping run $run_name on $name (SIGTERM to its trainers: they checkpoint first)" >&2
  on all "$(stop_cmd 'train-w*.pid')" || true
  wait "$ssh_pid" || true
  stop_refresher || true
  exit 143
}

# Each detached command is `setup && { cmd > log 2>&1 < /dev/null & echo $! > pid; }`: only the
# command itself goes to the background, its output redirected, so that the ssh session ends at
# once. (`setup && cmd > log &` backgrounds the whole list in a subshell that keeps the
# session's stdout open until cmd ends, and runs W=... and mkdir there, not before `echo $!`.)
train="cd $REMOTE_DIR && mkdir -p $logs && ${exports}W=$WORKER_ID && log=$logs/train-w\$W.log"
if (( wait )); then
  echo "training on all workers (foreground; logs $logs/train-w*.log)"
  foreground="$train && echo \$\$ > $logs/train-w\$W.pid && exec $(cli_args train --multihost) \
    > \$log 2>&1 < /dev/null"
  if (( dry_run )); then
    on all "$foreground"
    rc=0
  else
    # SIGTERM or SIGINT here (the sweep's worker ended or stops, Ctrl-C) stops the trainers on
    # the workers too (they checkpoint first), waits for them, and stops the refresher: an
    # ended ssh session alone would leave them holding the slice's chips. The ssh runs in the
    # background, so that `wait` returns to the trap at once, and ignores both signals (a
    # SIGINT to the process group too), so that it lasts as long as the trainers.
    trap stop_foreground TERM INT
    ( trap '' TERM INT; on all "$foreground" ) &
    ssh_pid=$!
    set +e
    wait "$ssh_pid"
    rc=$?
    set -e
    trap - TERM INT
  fi
  stop_refresher
  echo "training finished (exit status $rc)"
  exit "$rc"
fi
on all "$train && { setsid nohup $(cli_args train --multihost) > \$log 2>&1 < /dev/null &
  echo \$! > $logs/train-w\$W.pid; echo \"\$(hostname): train pid \$!, log \$log\"; }"
echo "launched run $run_name on $name. Watch: gcloud compute tpus tpu-vm ssh $name --zone=$zone \
--worker=0 --command='tail -f $logs/train-w0.log'"
echo "stop: tpu/launch.sh --stop ${slice_flag}--run $run_name $name $zone $workdir $spec"
