"""One sweep worker: `python -m realm_jax.sweep.worker PLAN_JSON` (started by study.py).

It takes trials from the study until there are none left for it: a waiting trial first (a grid
point, a lost trial's retry, an interrupted trial), else for a search a new trial from the
sampler while fewer than `trials` are finished or running. Each trial trains as its own process,
the task's training command (space.RUN_COMMAND) in PREFIX/<trial name> with REALM_JAX_TRIAL set
(sweep/trial.py: the trainer reports each held-out evaluation and stops when pruned), or on the
worker's TPU slice through tpu/launch.sh --wait. Its output goes to its workdir's sweep.log and
to the console prefixed `[trial N NAME]`; the worker beats the trial's heartbeat meanwhile
(storage.py). The trainer dies with its worker (PR_SET_PDEATHSIG: SIGTERM, it checkpoints), and
it writes its log itself, so a worker killed with -9 loses nothing the retry would need.

When the trainer exits: PRUNED in its workdir -> the trial is PRUNED (at the step it names);
exit status 0 with metrics.json complete -> COMPLETE with the objective's latest held-out value;
else FAIL (why, and the log, in the table). A worker with nothing to take waits while other
workers' trials run, failing those whose heartbeat stopped (their retry may come its way).
SIGINT or SIGTERM: the trainer gets SIGINT (it checkpoints and exits), the trial is failed and
enqueued again with the same params (a re-run resumes it), exit status 130.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

from realm_jax import fs
from realm_jax.config import ConfigError, load_config
from realm_jax.sweep import space, storage, table
from realm_jax.sweep.launch import (
    Plan,
    data_folder,
    die_with_parent,
    echo,
    log_path,
    prepare_command,
    stream_plain,
    trial_command,
)
from realm_jax.workdir import metrics_path, pruned_path

POLL_S = 0.25  # how often the worker reads its trainer's log and checks its exit


def _minutes(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s"


class Worker:
    """The trial loop of one worker (module docstring)."""

    def __init__(self, plan: Plan):
        import optuna

        self.plan = plan
        self.sweep = space.load(plan.spec, plan.extra)
        self.base = load_config(self.sweep.spec, self.sweep.extra)
        self.storage = storage.open_storage(plan.storage)
        self.study = storage.retrying(
            lambda: optuna.load_study(
                study_name=plan.study,
                storage=self.storage,
                sampler=self.sweep.make_sampler(plan.worker),
                pruner=optuna.pruners.NopPruner(),
            ),
            "loading the study",
        )
        self.prepared = set(plan.prepared)
        self.stopping = False
        self.child: subprocess.Popen | None = None
        self.ran = 0

    # ------------------------------------------------------------------ signals
    def on_signal(self, signum, _frame) -> None:
        """SIGINT/SIGTERM: the trainer checkpoints and exits (one SIGINT to its process group),
        then the worker stops taking trials."""
        if self.stopping:
            return
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            try:
                os.killpg(self.child.pid, signal.SIGINT)
            except ProcessLookupError:
                pass

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        while not self.stopping:
            storage.retrying(
                lambda: storage.fail_stale(self.study, self.plan.grace_s),
                "failing stale trials",
                self.plan.retry_s,
            )
            got = storage.retrying(self.next_trial, "taking a trial", self.plan.retry_s)
            if got is None:
                if not self._others_running():
                    break
                self._sleep(min(self.plan.heartbeat_s, 5.0))
                continue
            self.run_trial(*got)
        return 130 if self.stopping else 0

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < end:
            time.sleep(POLL_S)

    def _others_running(self) -> bool:
        from optuna.trial import TrialState

        states = (TrialState.RUNNING, TrialState.WAITING)
        return bool(
            storage.retrying(
                lambda: self.study.get_trials(deepcopy=False, states=states),
                "reading the study",
                self.plan.retry_s,
            )
        )

    def next_trial(self):
        """(optuna Trial, frozen trial) this worker now runs, or None."""
        import optuna
        from optuna.trial import TrialState

        st = self.study._storage
        waiting = self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        for t in sorted(waiting, key=lambda t: t.number):
            try:
                if not st.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
                    continue  # another worker took it
            except optuna.exceptions.UpdateFinishedTrialError:
                continue
            storage.beat(st, t._trial_id)
            return optuna.trial.Trial(self.study, t._trial_id), st.get_trial(t._trial_id)
        if self.sweep.kind != "search":
            return None
        trials = self.study.get_trials(deepcopy=False)
        finished = sum(t.state.name in ("COMPLETE", "PRUNED", "RUNNING") for t in trials)
        failed = sum(t.state.name == "FAIL" and t.number >= self.plan.first_number for t in trials)
        if finished >= self.plan.trials:
            return None
        if failed >= self.plan.trials:  # a search whose every trial fails: not forever
            print(
                f"sweep: worker {self.plan.worker}: {failed} trials failed in this run; "
                "taking no new ones",
                flush=True,
            )
            return None
        trial = self.study.ask()
        storage.beat(st, trial._trial_id)
        return trial, st.get_trial(trial._trial_id)

    # ------------------------------------------------------------------ one trial
    def _point(self, trial, frozen) -> dict:
        """The trial's params, set in the study (a grid's and a retry's are fixed)."""
        fixed = table.trial_params(frozen)
        point = {}
        for key, p in self.sweep.params.items():
            if self.sweep.kind == "grid" and key not in fixed:
                continue  # a grid point that leaves this field to the config
            point[key] = space.suggest(trial, key, p)
        return point

    def _workdir(self, frozen, point: dict) -> tuple[str, str]:
        """(name, workdir): a retry's own (it resumes there), else PREFIX/<params>, with
        ,trial=N added when a finished or running trial already trains there."""
        if frozen.user_attrs.get("workdir"):
            return frozen.user_attrs["name"], frozen.user_attrs["workdir"]
        name = space.run_name(point)
        taken = {
            t.user_attrs.get("workdir")
            for t in self.study.get_trials(deepcopy=False)
            if t.number != frozen.number and t.state.name in ("COMPLETE", "PRUNED", "RUNNING")
        }
        if fs.join(self.plan.prefix, name) in taken:
            name = f"{name},trial={frozen.number}"
        return name, fs.join(self.plan.prefix, name)

    def run_trial(self, trial, frozen) -> None:
        st, plan = self.study._storage, self.plan
        start = time.time()
        try:
            point = self._point(trial, frozen)
            name, workdir = self._workdir(frozen, point)
            for key, value in (
                ("name", name),
                ("workdir", workdir),
                ("worker", f"{socket.gethostname()}:{os.getpid()}"),
            ):
                st.set_trial_user_attr(trial._trial_id, key, value)
            config = space.point_config(self.sweep, point, where=f"trial {frozen.number}")
            folder = data_folder(config, self.base, plan.prefix)
            self._prepare(point, folder)
        except (ConfigError, ValueError) as e:  # a point that does not apply: the trial fails
            self._fail(trial, frozen.number, " ".join(str(e).split())[:300])
            return
        if self.stopping:  # interrupted while it prepared: run it another time
            self._interrupted(trial, frozen, "before it started")
            return
        link = json.dumps(
            {
                "storage": plan.storage,
                "study": plan.study,
                "trial_id": trial._trial_id,
                "objective": self.sweep.objective,
                "direction": self.sweep.direction,
                "retry_s": plan.retry_s,
                "pruner": self.sweep.pruner_spec(),
            }
        )
        cmd = trial_command(plan, self.sweep.task, name, workdir, point, folder, link)
        fs.makedirs(workdir)
        fs.remove(pruned_path(workdir))  # an earlier trial's in this folder
        label = f"[trial {frozen.number} {name}]"
        print(
            f"sweep: trial {frozen.number} {name} (worker {plan.worker}): "
            + storage.redact(shlex.join(cmd)),
            flush=True,
        )
        rc = self._stream(cmd, label, log_path(workdir), trial._trial_id, link)
        if fs.is_remote(workdir):
            fs.write_bytes(fs.join(workdir, "sweep.log"), fs.read_bytes(log_path(workdir)))
        self._end(trial, frozen, rc, workdir, time.time() - start)

    def _prepare(self, point: dict, folder: str) -> None:
        """The trial's data folder prepared once (under a lock: one worker prepares, the others
        wait and reuse it). With --tpu the data must be there already (study.py checks)."""
        if folder in self.prepared or self.plan.tpu:
            return
        import fcntl

        digest = hashlib.sha1(folder.encode()).hexdigest()[:8]
        with open(os.path.join(self.plan.prefix, f".prepare-{digest}.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or we die)
            if (
                stream_plain(
                    prepare_command(self.plan, point, folder), f"[prepare {fs.basename(folder)}]"
                )
                != 0
            ):
                raise ConfigError(f"preparing {folder} failed (above)")
        self.prepared.add(folder)

    def _stream(self, cmd, label: str, path: str, trial_id: int, link: str) -> int:
        """Run the trainer with its output appended to `path`, echo each new line with `label`,
        beat the heartbeat; returns its exit status."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        env = dict(os.environ, REALM_JAX_TRIAL=link)
        with open(path, "ab") as log:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
            log.write(f"# {stamp} {storage.redact(shlex.join(cmd))}\n".encode())
            log.flush()
            offset = log.tell()
            self.child = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        if self.stopping:  # a signal came while it started
            os.killpg(self.child.pid, signal.SIGINT)
        last_beat, rest = time.monotonic(), b""
        with open(path, "rb") as f:
            f.seek(offset)
            while True:
                rc = self.child.poll()
                rest = echo(rest + f.read(), label, final=rc is not None)
                if rc is not None:
                    break
                if time.monotonic() - last_beat >= self.plan.heartbeat_s:
                    last_beat = time.monotonic()
                    try:
                        storage.beat(self.study._storage, trial_id)
                    except Exception as e:  # the storage is down: the trial trains on
                        print(
                            f"sweep: heartbeat of trial {trial_id} failed: {type(e).__name__}",
                            flush=True,
                        )
                time.sleep(POLL_S)
        self.child = None
        return rc

    def _end(self, trial, frozen, rc: int, workdir: str, wall: float) -> None:
        """Tell the study how the trial ended, then the progress line and the table."""
        from optuna.trial import TrialState

        pruned = table._read_json(pruned_path(workdir))
        metrics = table._read_json(metrics_path(workdir))
        key = self.sweep.objective.removeprefix("eval/")
        if rc == 0 and pruned:
            self._tell(trial, state=TrialState.PRUNED)
            outcome = f"PRUNED at step {pruned.get('step')}"
        elif rc == 0 and metrics.get("complete") and key in metrics.get("eval", {}):
            value = float(metrics["eval"][key])
            self._tell(trial, value)
            outcome = f"COMPLETE {self.sweep.objective}={value:.4g}"
        else:
            if rc == 0 and metrics.get("complete"):
                why = f"metrics.json has no held-out {self.sweep.objective}"
            elif rc == 0:
                why = f"stopped at step {metrics.get('step')} of {metrics.get('steps')}"
            else:
                why = f"exit status {rc}"
            if self.stopping:
                self._interrupted(trial, frozen, why)
                outcome = "interrupted: enqueued again (a re-run resumes it)"
            else:
                self._fail(trial, frozen.number, f"{why}; log {log_path(workdir)}")
                outcome = f"FAIL ({why})"
        self.ran += 1
        self._progress(frozen.number, outcome, wall)

    def _tell(self, trial, value=None, state=None) -> None:
        def tell():
            self.study.tell(trial, value, state=state, skip_if_finished=True)

        storage.retrying(tell, f"telling trial {trial.number}", self.plan.retry_s)

    def _fail(self, trial, number: int, why: str) -> None:
        from optuna.trial import TrialState

        st = self.study._storage
        storage.retrying(
            lambda: st.set_trial_user_attr(trial._trial_id, "fail_reason", why),
            "recording a failure",
            self.plan.retry_s,
        )
        self._tell(trial, state=TrialState.FAIL)
        print(f"sweep: trial {number} failed: {why}", file=sys.stderr, flush=True)

    def _interrupted(self, trial, frozen, why: str) -> None:
        """Fail the interrupted trial and enqueue it again (same params, same workdir), not
        counted as a retry of a lost trial."""
        import optuna
        from optuna.trial import TrialState

        st = self.study._storage
        st.set_trial_user_attr(trial._trial_id, "fail_reason", f"interrupted ({why})")
        self._tell(trial, state=TrialState.FAIL)
        t = st.get_trial(trial._trial_id)
        attrs = {k: v for k, v in t.user_attrs.items() if k != "fail_reason"}
        self.study.add_trial(
            optuna.trial.create_trial(
                state=TrialState.WAITING,
                params=t.params,
                distributions=t.distributions,
                user_attrs={**attrs, "rerun_of": t.number},
                system_attrs={k: v for k, v in t.system_attrs.items() if k != storage.HEARTBEAT},
            )
        )

    def _progress(self, number: int, outcome: str, wall: float) -> None:
        """One line: how the trial ended, the study's counts, the best so far, an ETA."""
        trials = self.study.get_trials(deepcopy=False)
        count = {
            s: sum(t.state.name == s for t in trials)
            for s in ("COMPLETE", "PRUNED", "FAIL", "RUNNING", "WAITING")
        }
        done = count["COMPLETE"] + count["PRUNED"]
        if self.sweep.kind == "search":
            left = max(self.plan.trials - done - count["RUNNING"], 0) + count["WAITING"]
            total = f" of {self.plan.trials}"
        else:
            left, total = count["WAITING"], f" of {len(self.sweep.points)} points"
        walls = [
            (t.datetime_complete - t.datetime_start).total_seconds()
            for t in trials
            if t.state.name in ("COMPLETE", "PRUNED") and t.number >= self.plan.first_number
        ]
        eta = ""
        if walls:
            per = sum(walls) / len(walls)
            eta = f"; ETA {_minutes(per * (left + count['RUNNING']) / self.plan.workers)}"
        best = table.best_trial(self.study)
        best_text = f"; best {best.value:.4g} (trial {best.number})" if best else ""
        print(
            f"sweep: trial {number} {outcome} in {_minutes(wall)} | {done}{total} done "
            f"({count['COMPLETE']} complete, {count['PRUNED']} pruned), {count['FAIL']} failed, "
            f"{count['RUNNING']} running{best_text}{eta}",
            flush=True,
        )
        try:
            table.write(self.study, self.plan.prefix)
        except Exception as e:  # the table is a view: a failure to write it stops nothing
            print(f"sweep: the table was not rewritten: {type(e).__name__}: {e}", flush=True)


def main(argv: list[str] | None = None) -> int:
    import logging
    import warnings

    argv = sys.argv[1:] if argv is None else argv
    plan = Plan(**json.loads(argv[0]))
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
    try:
        worker = Worker(plan)
    except ConfigError as e:
        print(f"realm-jax sweep: worker {plan.worker}: error: {e}", file=sys.stderr, flush=True)
        return 2
    signal.signal(signal.SIGINT, worker.on_signal)
    signal.signal(signal.SIGTERM, worker.on_signal)
    return worker.run()


if __name__ == "__main__":
    sys.exit(main())
