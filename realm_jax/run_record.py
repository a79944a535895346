"""A workdir remembers its config: <workdir>/run_config.json (api.RUN_CONFIG).

Every CLI command on a workdir reads it back (`resolve`): the recorded config and overrides,
then the command line's overrides on top, so `realm-jax ask --workdir runs/mine-qa "q"` needs
no --config. The commands that build a workdir's data or networks (prepare, train, local, ict,
finetune, import: RECORDS) write it (`write`, from cli): the training commands after validation
and before any work, marked unfinished, then finished when they succeed; prepare and import
once they succeed. evaluate, ask, refresh and export only read it.

How a command's config is decided (docs/reference.md "A workdir remembers its config"):
  - no record: --config (default configs/realm.py:smoke) and the command line's overrides;
  - no --config: the recorded config + recorded overrides + the command line's;
  - --config equal to the recorded one: the same, unless the record is of a first run that
    failed before its first step (unsettled: not finished, no checkpoint past step 0), which
    the command line replaces (so a failed first run never blocks a rerun);
  - --config different from the recorded one: the command line's alone (the recorded
    overrides belong to the other config), with a warning line; a training command on a
    workdir that holds checkpoints past step 0 of the recorded config is refused (exit 2).
"""

from __future__ import annotations

import json
import os
import sys

from realm_jax import fs
from realm_jax import workdir as paths

RUN_CONFIG = "run_config.json"  # = api.RUN_CONFIG
# commands that write a workdir's data or networks: they record the config they ran with
RECORDS = ("prepare", "train", "local", "ict", "finetune", "import")
TRAINING = ("train", "local", "ict", "finetune")


def _path(workdir: str) -> str:
    return fs.join(paths.root(workdir), RUN_CONFIG)


def normalize(spec: str) -> str:
    """'configs/x.py:variant' with the file made absolute (how records name configs)."""
    from realm_jax.config import split_spec

    path, variant = split_spec(spec)
    return os.path.abspath(path) + (f":{variant}" if variant else "")


def shown(spec: str) -> str:
    """A recorded spec as a user would type it here: relative when under the working dir."""
    path, _, variant = spec.partition(":")
    rel = os.path.relpath(path) if os.path.isabs(path) else path
    path = rel if not rel.startswith("..") else path
    return path + (f":{variant}" if variant else "")


def read(workdir: str) -> dict | None:
    """The workdir's record ({config, overrides, cwd, command, finished}), None when none."""
    if not workdir:
        return None
    # a gs:// workdir's store first (once per bucket): one line when it cannot be used (no
    # bucket, no access, unreachable), not gcsfs's minute of logged retries on the record
    fs.check_buckets([workdir])
    path = _path(workdir)
    try:
        if not fs.isfile(path):
            return None
        got = json.loads(fs.read_text(path))
    except (OSError, ValueError) as e:
        print(f"realm-jax: warning: {path} unreadable ({e}); ignored", file=sys.stderr)
        return None
    if not isinstance(got, dict) or not isinstance(got.get("config"), str):
        return None
    got["overrides"] = [str(o) for o in got.get("overrides", [])]
    return got


def write(workdir: str, spec: str, overrides: list[str], command: str, finished: bool) -> None:
    """Write the record (process 0 only: the caller's choice)."""
    fs.makedirs(paths.root(workdir))
    got = {
        "config": normalize(spec),
        "overrides": list(overrides),
        "cwd": os.getcwd(),
        "command": command,
        "finished": bool(finished),
    }
    fs.write_text(_path(workdir), json.dumps(got, indent=1) + "\n")


def _key(item: str) -> str:
    return item.split("=", 1)[0].removeprefix("--").removeprefix("config.")


def merged(recorded: list[str], given: list[str]) -> list[str]:
    """Recorded overrides then the given ones, one per key (the last value, in first order)."""
    out: dict[str, str] = {}
    for item in [*recorded, *given]:
        out[_key(item)] = item
    return list(out.values())


def checkpoint_steps(workdir: str) -> list[int]:
    """The steps of the workdir's checkpoints (folder names; nothing restored)."""
    folder = paths.checkpoint_dir(workdir)
    try:
        if not fs.isdir(folder):
            return []
        names = fs.listdir(folder)
    except OSError:
        return []
    return sorted(int(n) for n in (os.path.basename(n.rstrip("/")) for n in names) if n.isdigit())


def settled(workdir: str, record: dict) -> bool:
    """A record of a command that finished, or of a run that got past its first step."""
    return bool(record.get("finished", True)) or any(s > 0 for s in checkpoint_steps(workdir))


class Resolved:
    """What a command runs with: spec, overrides (all of them, in order), and the lines to
    say (notes), or an error (a ConfigError to raise)."""

    def __init__(self, spec: str, overrides: list[str], notes: list[str], from_record: bool):
        self.spec, self.overrides, self.notes, self.from_record = (
            spec,
            overrides,
            notes,
            from_record,
        )


def resolve(command: str, workdir: str, spec: str | None, given: list[str]) -> Resolved:
    """The config spec and overrides a command runs with (the module docstring's rules)."""
    from realm_jax.config import ConfigError, default_config_path

    record = read(workdir)
    if record is None:
        return Resolved(spec or f"{default_config_path()}:smoke", list(given), [], False)
    where = f"workdir {workdir}"
    rec_spec, rec_over = record["config"], record["overrides"]
    if spec is not None and normalize(spec) != rec_spec:
        if command in TRAINING and any(s > 0 for s in checkpoint_steps(workdir)):
            raise ConfigError(
                f"{where} holds checkpoints of a run with config {shown(rec_spec)}, not "
                f"{spec}: omit --config to go on with the recorded one, or use a new --workdir"
            )
        note = (
            f"{where}: warning: --config {spec} is not the recorded config "
            f"{shown(rec_spec)}; its {len(rec_over)} recorded overrides are not applied"
        )
        return Resolved(spec, list(given), [note], False)
    if spec is not None and not settled(workdir, record):
        keys = {_key(g) for g in given}
        dropped = [o for o in rec_over if _key(o) not in keys]
        notes = [
            f"{where}: its record ({record.get('command', '?')} with {shown(rec_spec)}) is of "
            "a first run that did not finish: this command line replaces it (not applied: "
            f"{' '.join('--config.' + o for o in dropped)})"
        ] * bool(dropped)
        return Resolved(spec, list(given), notes, False)
    rec_over = _from_recorded_cwd(rec_over, record.get("cwd", ""))
    return Resolved(rec_spec, merged(rec_over, given), [], True)


# overrides naming a file or folder: a relative one recorded in another working directory is
# read from there when it exists there and not here (a command run from elsewhere)
PATH_KEYS = ("data.corpus", "data.sentences", "data.data_dir", "qa.train_file", "qa.dev_file")


def _from_recorded_cwd(overrides: list[str], cwd: str) -> list[str]:
    if not cwd or os.path.abspath(cwd) == os.getcwd():
        return overrides
    out = []
    for item in overrides:
        key, _, value = item.partition("=")
        is_path = (_key(key) in PATH_KEYS or _key(key).startswith("model.init_")) and value
        if is_path and "://" not in value and not os.path.isabs(value):
            there = os.path.join(cwd, value)
            if not os.path.exists(value) and os.path.exists(there):
                item = f"{key}={there}"
        out.append(item)
    return out


def describe(
    workdir: str, resolved: Resolved, given: list[str], before, after, explicit: bool = False
) -> str | None:
    """One line: the recorded config and what this command's overrides change in it; None
    when the record adds nothing to the command line (the same command run again): its
    config given or the default, every recorded override repeated, nothing changed."""
    if not resolved.from_record:
        return None
    from realm_jax.config import _get, default_config_path

    record = read(workdir) or {}
    recorded = record.get("overrides", [])
    n = len(recorded)
    keys = {_key(g) for g in given}
    added = [o for o in recorded if _key(o) not in keys]
    default = normalize(f"{default_config_path()}:smoke")
    changes = []
    for item in given:
        key = _key(item)
        old, new = _get(before, key), _get(after, key)
        if old != new:
            changes.append(f"{key} {_fmt(old)} -> {_fmt(new)}")
    if not changes and not added and (explicit or normalize(resolved.spec) == default):
        return None
    said = f"; this command changes {', '.join(changes)}" if changes else ""
    s = "" if n == 1 else "s"
    return f"workdir {workdir}: config {shown(resolved.spec)} + {n} recorded override{s}{said}"


def _fmt(v) -> str:
    if isinstance(v, str):
        return repr(v) if (v == "" or " " in v) else v
    if isinstance(v, tuple):
        return "(" + ",".join(str(x) for x in v) + ")"
    return str(v)
