"""A config file's sweep(): a grid of points or a search space, read and checked before anything
runs, and each trial's point turned into its config's overrides.

    from realm_jax.sweep import space

    def sweep():                # a grid: every point runs (Optuna trials with fixed params)
        return [{"train.lr": lr} for lr in (1e-4, 3e-4)]

    def sweep(variant=None):    # or, per variant, a search (a sampler proposes each trial)
        return space.Search(
            params={"train.lr": space.log_uniform(1e-5, 1e-3),
                    "train.num_candidates": space.choice([8, 16])},
            objective="eval/title_recall@5", direction="maximize",
            sampler="tpe", pruner="median", trials=16, seed=0)

A plain list is a Grid with the task's default objective (DEFAULT_OBJECTIVE) and no pruner;
`Grid(points, objective=..., direction=..., pruner=...)` names its own. sweep() may take the
variant (`sweep(variant)`): configs/realm.py's world variant searches, the others keep a grid.
`load()` applies every grid point, and a search's bounds and choices, to the config with the
sweep's common overrides and validates it, and checks the objective against the metrics the
task's held-out evaluation gives there: a bad space is one ConfigError line before anything
runs. Parameters are named by their config keys ("train.lr"), as Optuna stores them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from realm_jax.config import ConfigError, load_config, split_spec, validate
from realm_jax.sweep.points import format_value, read_sweep, resolve_spec, run_name

# The task's objective when a sweep does not name one: its console's first held-out metric
DEFAULT_OBJECTIVE = {"realm": "eval/accuracy", "ict": "eval/recall@5", "qa": "eval/exact_match"}
# The command that trains a config's task (cli.TASK_COMMANDS): REALM's `local` runs the refresh
# job beside the trainer (none with refresh.mode=inprocess or amortized)
RUN_COMMAND = {"realm": "local", "ict": "train", "qa": "finetune"}
DIRECTIONS = ("maximize", "minimize")
SAMPLERS = {  # name -> Optuna class (optuna.samplers); cmaes needs the `cmaes` package
    "tpe": "TPESampler",
    "random": "RandomSampler",
    "cmaes": "CmaEsSampler",
    "grid": None,  # a search of choice() params only, expanded into its grid's points
}
PRUNERS = ("median", "halving", "hyperband", "none")  # sweep/trial.py builds them
PRIMITIVE = (bool, int, float, str, type(None))  # what Optuna stores as a categorical choice


@dataclasses.dataclass(frozen=True)
class Param:
    """One searched config field: kind log_uniform | uniform | integer | choice."""

    kind: str
    low: float | int | None = None
    high: float | int | None = None
    values: tuple = ()
    step: int = 1
    log: bool = False


def log_uniform(low: float, high: float) -> Param:
    """A float drawn uniformly in log space, low > 0 (learning rates)."""
    return Param("log_uniform", low, high, log=True)


def uniform(low: float, high: float) -> Param:
    return Param("uniform", low, high)


def integer(low: int, high: int, *, step: int = 1, log: bool = False) -> Param:
    """An integer in [low, high] (both included), every `step`, optionally log-spaced."""
    return Param("integer", low, high, step=step, log=log)


def choice(values) -> Param:
    """One of these values (bool, int, float, str or None)."""
    return Param("choice", values=tuple(values) if isinstance(values, list | tuple) else values)


@dataclasses.dataclass(kw_only=True)
class _Sweep:
    """What a grid and a search both name (keywords only): the objective, its direction and the
    pruner that stops a trial behind the others."""

    objective: str | None = None
    direction: str = "maximize"
    pruner: str = "none"
    pruner_args: dict = dataclasses.field(default_factory=dict)  # e.g. {"n_startup_trials": 2}


@dataclasses.dataclass
class Search(_Sweep):
    """A search space with its sampler; see the module docstring."""

    params: dict
    pruner: str = dataclasses.field(default="median", kw_only=True)
    sampler: str = "tpe"
    trials: int = 16
    seed: int = 0
    sampler_args: dict = dataclasses.field(default_factory=dict)  # the Optuna class's kwargs


@dataclasses.dataclass
class Grid(_Sweep):
    """A list of points (override dicts), each run once, with its objective."""

    points: list


@dataclasses.dataclass
class Study:
    """A config's sweep, checked: what the engine runs."""

    spec: str  # 'configs/realm.py:world'
    extra: list[str]  # the overrides every trial gets first ("k=v")
    task: str
    kind: str  # "grid" or "search"
    params: dict[str, Param]  # the searched fields (a grid: a choice of each key's values)
    points: list[dict]  # a grid's points, in order
    objective: str  # "eval/<metric>"
    direction: str
    sampler: str = "grid"
    sampler_args: dict = dataclasses.field(default_factory=dict)
    pruner: str = "none"
    pruner_args: dict = dataclasses.field(default_factory=dict)
    trials: int = 0  # a search's number of finished (complete or pruned) trials
    seed: int = 0

    def pruner_spec(self) -> dict:
        """The pruner as REALM_JAX_TRIAL carries it (sweep/trial.py make_pruner)."""
        return {"name": self.pruner, **self.pruner_args}

    def distributions(self) -> dict:
        """{key: Optuna distribution}."""
        return {key: distribution(p) for key, p in self.params.items()}

    def make_sampler(self, worker: int = 0):
        """The sampler of worker `worker` (seeded seed + worker: workers must not propose the same
        points). A grid's trials are all enqueued with their params: any sampler would do."""
        import optuna

        if self.sampler in ("grid", "random"):
            return optuna.samplers.RandomSampler(seed=self.seed + worker)
        args = dict(self.sampler_args)
        if self.sampler == "tpe":  # parallel workers: a running trial counts as a poor one
            args.setdefault("constant_liar", True)
        return getattr(optuna.samplers, SAMPLERS[self.sampler])(seed=self.seed + worker, **args)

    def point_name(self, point: dict) -> str:
        return run_name(point)

    def to_attrs(self) -> dict:
        """What the storage keeps of the sweep (study user attrs): `sweep --table` and the best
        trial's command read it back."""
        return {
            "spec": self.spec,
            "extra": list(self.extra),
            "task": self.task,
            "kind": self.kind,
            "objective": self.objective,
        }


def distribution(p: Param):
    from optuna import distributions as d

    if p.kind == "choice":
        return d.CategoricalDistribution(p.values)
    if p.kind == "integer":
        return d.IntDistribution(int(p.low), int(p.high), log=p.log, step=p.step)
    return d.FloatDistribution(float(p.low), float(p.high), log=p.log)


def suggest(trial, key: str, p: Param):
    """The trial's value of `key` (sampled, or the one it already has: a grid's, a retry's)."""
    if p.kind == "choice":
        return trial.suggest_categorical(key, p.values)
    if p.kind == "integer":
        return trial.suggest_int(key, int(p.low), int(p.high), step=p.step, log=p.log)
    return trial.suggest_float(key, float(p.low), float(p.high), log=p.log)


def overrides(point: dict) -> list[str]:
    """{"train.lr": 1e-4} -> ["train.lr=0.0001"] (as --config.k=v takes them)."""
    return [f"{key}={format_value(v)}" for key, v in point.items()]


def eval_metrics(config) -> set[str]:
    """The "eval/<metric>" keys the task's held-out evaluation gives with this config (the
    evaluations' own keys: pretrain/evaluation.py, ict/evaluation.py, qa/evaluation.py)."""
    task = config.get("task", "realm")
    if task == "realm":
        k = int(config.train.num_candidates) - 1  # title_recall@1, @5 and @K-1 (those <= K-1)
        names = {"loss", "accuracy", "null_only_accuracy", "retrieval_utility"}
        names |= {"retrieval_entropy", "null_doc_prob", "same_title_fraction", "same_title_random"}
        names |= {"same_title_prior", "same_title_posterior", "title_queries", "examples"}
        names |= {"span_in_candidates", "accuracy_block_holds", "accuracy_block_lacks"}
        names |= {"copy_gain", "top1_share", "distinct_top1", "index_step"}
        names |= {f"title_recall@{j}" for j in {j for j in (1, 5) if j <= k} | {k}}
    elif task == "ict":
        ks = [int(j) for j in config.ict.recall_ks]
        names = {"examples", *(f"recall@{j}" for j in ks)}
        if config.ict.get("bm25_baseline", False):
            names |= {f"bm25_recall@{j}" for j in ks}
    elif task == "qa":
        names = {"questions", "exact_match", "best_step"}
        if config.qa.get("dev_retriever", "dense") == "gold":
            names |= {"gold_missing", "gold_answer_coverage"}
        else:
            names |= {f"recall@{int(j)}" for j in config.qa.recall_ks}
    else:
        raise ConfigError(f"task={task!r} has no training command for a sweep")
    return {f"eval/{n}" for n in names}


def load(config_spec: str, extra: list[str] | tuple[str, ...] = ()) -> Study:
    """The checked sweep of 'path.py[:variant]' (default variant: small) with the common
    overrides `extra` ("k=v"); ConfigError (one line) on anything that would fail later."""
    spec = resolve_spec(config_spec)
    path, variant = split_spec(spec)
    extra = list(extra)
    try:
        base = load_config(spec, extra)
    except ConfigError as e:
        raise ConfigError(f"{spec}: the sweep's common overrides: {e}") from None
    task = base.get("task", "realm")
    value = read_sweep(path, variant)
    if isinstance(value, list | tuple):
        value = Grid(points=list(value))
    if isinstance(value, Search) and value.sampler == "grid":
        value = _grid_of(path, value)
    if isinstance(value, Grid):
        study = _grid(path, spec, extra, task, value)
    elif isinstance(value, Search):
        study = _search(path, spec, extra, task, value)
    else:
        raise ConfigError(
            f"{path}: sweep() must return a list of override dicts, space.Grid or space.Search, "
            f"got {type(value).__name__}"
        )
    _check_controls(path, study)
    for name, point in _check_points(study):  # every point (a search: its corners) validates
        _check_point(path, study, name, point)
    return study


def _objective(path: str, task: str, objective, direction) -> tuple[str, str]:
    if task not in DEFAULT_OBJECTIVE:
        raise ConfigError(f"task={task!r} has no training command for a sweep")
    objective = objective or DEFAULT_OBJECTIVE[task]
    if not isinstance(objective, str):
        raise ConfigError(f"{path}: the sweep's objective must be a metric name, got {objective!r}")
    if not objective.startswith("eval/"):
        objective = f"eval/{objective}"
    if direction not in DIRECTIONS:
        raise ConfigError(
            f"{path}: the sweep's direction {direction!r} must be one of {', '.join(DIRECTIONS)}"
        )
    return objective, direction


def _grid_points(path: str, points) -> list[dict]:
    if not isinstance(points, list | tuple) or not points:
        raise ConfigError(f"{path}: sweep() returned no points")
    for i, point in enumerate(points):
        if not isinstance(point, dict) or not point:
            raise ConfigError(f"{path}: sweep point {i} is not a non-empty dict: {point!r}")
        for key, v in point.items():
            if not isinstance(key, str) or "." not in key:
                raise ConfigError(f"{path}: sweep point {i}: {key!r} is not a config key (a.b)")
            if isinstance(v, Param):
                raise ConfigError(
                    f"{path}: sweep point {i}: {key} is a search parameter; return "
                    "space.Search(params=...) for a search"
                )
    names = [run_name(p) for p in points]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: sweep points have duplicate run names: {names}")
    return [dict(p) for p in points]


def _stored(v):
    """A grid value as Optuna stores it: primitives as they are, tuples as their override text."""
    return v if isinstance(v, PRIMITIVE) else format_value(v)


def _grid(path, spec, extra, task, g: Grid) -> Study:
    points = [{k: _stored(v) for k, v in p.items()} for p in _grid_points(path, g.points)]
    objective, direction = _objective(path, task, g.objective, g.direction)
    params: dict[str, list] = {}
    for p in points:
        for key, v in p.items():
            seen = params.setdefault(key, [])
            if not any(type(v) is type(w) and v == w for w in seen):
                seen.append(v)
    return Study(
        spec,
        extra,
        task,
        "grid",
        {k: Param("choice", values=tuple(v)) for k, v in params.items()},
        points,
        objective,
        direction,
        pruner=g.pruner,
        pruner_args=dict(g.pruner_args),
    )


def _grid_of(path: str, s: Search) -> Grid:
    """sampler="grid": the cartesian product of the choice() params."""
    import itertools

    if not isinstance(s.params, dict) or not s.params:
        raise ConfigError(f"{path}: space.Search needs params={{key: space.choice(...), ...}}")
    bad = [k for k, p in s.params.items() if not (isinstance(p, Param) and p.kind == "choice")]
    if bad:
        raise ConfigError(
            f"{path}: sampler='grid' takes choice() params only, not {', '.join(bad)}"
        )
    keys = list(s.params)
    for key in keys:
        _check_param(path, key, s.params[key])
    points = [dict(zip(keys, vs)) for vs in itertools.product(*(s.params[k].values for k in keys))]
    return Grid(
        points,
        objective=s.objective,
        direction=s.direction,
        pruner=s.pruner,
        pruner_args=dict(s.pruner_args),
    )


def _check_param(path: str, key: str, p) -> None:
    where = f"{path}: search parameter {key}"
    if not isinstance(key, str) or "." not in key:
        raise ConfigError(f"{path}: search parameter {key!r} is not a config key (a.b)")
    if not isinstance(p, Param):
        raise ConfigError(
            f"{where}: {p!r} is not a space.log_uniform/uniform/integer/choice(...) parameter"
        )
    if p.kind == "choice":
        if not isinstance(p.values, tuple) or not p.values:
            raise ConfigError(f"{where}: choice() needs a non-empty list of values")
        if not all(isinstance(v, PRIMITIVE) for v in p.values):
            raise ConfigError(f"{where}: choice() values must be bool, int, float, str or None")
        if len(set(map(repr, p.values))) != len(p.values):
            raise ConfigError(f"{where}: choice() values repeat: {list(p.values)}")
        return
    numbers = (p.low, p.high)
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in numbers):
        raise ConfigError(f"{where}: low and high must be numbers, got {p.low!r}, {p.high!r}")
    if not all(math.isfinite(v) for v in numbers) or not p.low < p.high:
        raise ConfigError(f"{where}: needs finite low < high, got {p.low!r}, {p.high!r}")
    if p.log and p.low <= 0:
        raise ConfigError(f"{where}: a log scale needs low > 0, got {p.low!r}")
    if p.kind == "integer":
        if not all(isinstance(v, int) for v in numbers) or not (
            isinstance(p.step, int) and p.step >= 1
        ):
            raise ConfigError(f"{where}: integer() needs int low, high and step >= 1")
        if p.log and p.step != 1:
            raise ConfigError(f"{where}: integer(log=True) takes no step")


def _search(path, spec, extra, task, s: Search) -> Study:
    if not isinstance(s.params, dict) or not s.params:
        raise ConfigError(f"{path}: space.Search needs params={{key: space.log_uniform(...), ...}}")
    for key, p in s.params.items():
        _check_param(path, key, p)
    objective, direction = _objective(path, task, s.objective, s.direction)
    if s.sampler not in SAMPLERS:
        raise ConfigError(f"{path}: sampler {s.sampler!r}: must be one of {', '.join(SAMPLERS)}")
    if isinstance(s.trials, bool) or not isinstance(s.trials, int) or s.trials < 1:
        raise ConfigError(f"{path}: trials must be a whole number >= 1, got {s.trials!r}")
    if isinstance(s.seed, bool) or not isinstance(s.seed, int):
        raise ConfigError(f"{path}: seed must be a whole number, got {s.seed!r}")
    return Study(
        spec,
        extra,
        task,
        "search",
        dict(s.params),
        [],
        objective,
        direction,
        s.sampler,
        dict(s.sampler_args),
        s.pruner,
        dict(s.pruner_args),
        s.trials,
        s.seed,
    )


def _check_controls(path: str, study: Study) -> None:
    """The sampler and the pruner build with their arguments (Optuna's own checks)."""
    import warnings

    import optuna

    from realm_jax.sweep.trial import make_pruner

    if study.pruner not in PRUNERS:
        raise ConfigError(f"{path}: pruner {study.pruner!r}: must be one of {', '.join(PRUNERS)}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        try:
            make_pruner(study.pruner_spec())
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{path}: pruner {study.pruner} {study.pruner_args}: {e}") from None
        if study.sampler == "cmaes":
            try:
                import cmaes  # noqa: F401
            except ImportError:
                raise ConfigError(
                    f"{path}: sampler 'cmaes' needs the cmaes package (pip install cmaes)"
                ) from None
        try:
            study.make_sampler()
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"{path}: sampler {study.sampler} {study.sampler_args}: {e}"
            ) from None


def _check_points(study: Study):
    """(label, point) for every point to validate: a grid's points; a search's corners (each
    numeric parameter at low and at high together) and each choice value."""
    if study.kind == "grid":
        yield from ((f"sweep point {i} ({p})", p) for i, p in enumerate(study.points))
        return
    for end in ("low", "high"):
        point = {}
        for key, p in study.params.items():
            point[key] = p.values[0] if p.kind == "choice" else getattr(p, end)
        yield f"the search at its {end} ends ({point})", point
    for key, p in study.params.items():
        for v in p.values[1:] if p.kind == "choice" else ():
            point = {
                k: (q.values[0] if q.kind == "choice" else q.low) for k, q in study.params.items()
            }
            point[key] = v
            yield f"the search with {key}={v!r}", point


def _check_point(path: str, study: Study, label: str, point: dict) -> None:
    config = point_config(study, point, where=f"{path}: {label}")
    got = eval_metrics(config)
    if study.objective not in got:
        raise ConfigError(
            f"{path}: {label}: the objective {study.objective} is not a metric the "
            f"{study.task} evaluation gives there (it gives: {', '.join(sorted(got))})"
        )


def point_config(study: Study, point: dict, where: str = ""):
    """The config a trial of `point` trains with, validated (ConfigError prefixed `where`)."""
    try:
        config = load_config(study.spec, [*study.extra, *overrides(point)])
        validate(config)
    except ConfigError as e:
        raise ConfigError(f"{where or study.spec}: {e}") from None
    if config.get("task", "realm") != study.task:
        raise ConfigError(f"{where}: changes config.task, which a sweep keeps")
    return config


def as_point(study: Study, params: dict[str, Any]) -> dict:
    """A trial's Optuna params as the point it trains (the space's key order)."""
    return {k: params[k] for k in study.params if k in params}
