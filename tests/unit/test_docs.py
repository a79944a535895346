"""Docs that run (issue 47): every command, option, config variant and field, make target,
relative link, section anchor and repo path the user-facing pages name exists in the code or
the repository, and the glossary defines every metric the training log prints. Part of
`make check`."""

import ast
import os
import re

import pytest

from realm_jax import cli
from realm_jax.config import load_config
from tests.conftest import REPO

PAGES = ["README.md", "tpu/README.md"] + [
    os.path.join("docs", f)
    for f in sorted(os.listdir(os.path.join(REPO, "docs")))
    if f.endswith(".md")
]
# the studies' pages, which docs/results.md and the README link
STUDIES = sorted(
    os.path.join("experiments", d, "README.md")
    for d in os.listdir(os.path.join(REPO, "experiments"))
    if os.path.exists(os.path.join(REPO, "experiments", d, "README.md"))
)
# named on purpose as bad input (docs/reliability.md's error table) or as a placeholder
DELIBERATE = {"configs/nope.py:smoke", "configs/realm.py:tiny", "--config.train.lrr", "--config.k"}


def _read(page: str) -> str:
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        return f.read()


def _code(text: str) -> str:
    """Inline code spans and fenced blocks: where the pages name things to type."""
    return "\n".join(
        re.findall(r"```[a-z]*\n(.*?)```", text, re.S) + re.findall(r"`([^`\n]+)`", text)
    )


def _subparsers() -> dict:
    parser = cli._parser()
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            return dict(action.choices)
    raise AssertionError("no subcommands")


def _makefile_targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z0-9-]*):", _read("Makefile"), re.M))


def _config_keys(spec: str) -> set[str]:
    out = set()

    def walk(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            out.add(prefix + k)

    walk(load_config(os.path.join(REPO, spec)).to_dict())
    return out


@pytest.mark.parametrize("page", PAGES + STUDIES)
def test_relative_links_exist(page):
    text = _read(page)
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not os.path.exists(os.path.join(REPO, os.path.dirname(page), target)):
            missing.append(target)
    assert not missing, f"{page}: links to missing files {missing}"


@pytest.mark.parametrize("page", PAGES)
def test_make_targets_exist(page):
    targets = _makefile_targets()
    named = set(re.findall(r"(?<![\w-])make ([a-z][a-z0-9-]*)", _code(_read(page))))
    assert not named - targets, f"{page}: make targets that do not exist: {named - targets}"


@pytest.mark.parametrize("page", PAGES)
def test_config_variants_load(page):
    bad = []
    for path, variant in set(re.findall(r"(configs/\w+\.py):(\w+)", _read(page))):
        if f"{path}:{variant}" in DELIBERATE:
            continue
        try:
            load_config(os.path.join(REPO, f"{path}:{variant}"))
        except Exception as e:  # noqa: BLE001 - any failure is the finding
            bad.append(f"{path}:{variant} ({e})")
    assert not bad, f"{page}: {bad}"


@pytest.mark.parametrize("page", PAGES)
def test_commands_and_their_options_exist(page):
    """`realm-jax CMD ...` / `python -m realm_jax CMD ...` lines: CMD is a command, each --flag
    one of its options, each --config.a.b a field of some config file."""
    subs = _subparsers()
    keys = set()
    for spec in ("configs/realm.py:smoke", "configs/ict.py:smoke", "configs/orqa.py:smoke"):
        keys |= _config_keys(spec)
    bad = []
    for line in _code(_read(page)).splitlines():
        m = re.search(r"(?:realm-jax|python -m realm_jax)\s+([a-z][a-z_-]*)(.*)", line)
        if not m or m.group(1) in ("train,", "ict,"):
            continue
        cmd, rest = m.group(1), m.group(2)
        if cmd not in subs:
            bad.append(f"unknown command {cmd!r} in: {line.strip()}")
            continue
        options = {o for a in subs[cmd]._actions for o in a.option_strings}
        for flag in re.findall(r"(?<![\w.])(--[a-z][a-z0-9_]*(?:\.[a-z0-9_.]+)?)", rest):
            if flag in DELIBERATE:
                continue
            if flag.startswith("--config."):
                if flag[len("--config.") :].rstrip(".") not in keys:
                    bad.append(f"unknown config field {flag} in: {line.strip()}")
            elif flag not in options:
                bad.append(f"{cmd} has no option {flag}: {line.strip()}")
    assert not bad, f"{page}:\n" + "\n".join(bad)


def test_the_index_lists_every_command():
    text = _read("docs/reference.md")
    missing = [c for c in cli.COMMANDS if f"### {c}" not in text and f"`{c}`" not in text]
    assert not missing, f"docs/reference.md does not document {missing}"


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated heading's with -1, -2, ...; headings in fenced code are none."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    out, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+?)\s*#*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES + STUDIES)
def test_link_anchors_exist(page):
    """A link to a section of a page (page.md#section) names a heading the page has."""
    bad = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", _read(page)):
        path = os.path.normpath(os.path.join(os.path.dirname(page), target)) if target else page
        if path.endswith(".md") and os.path.exists(os.path.join(REPO, path)):
            if anchor not in heading_anchors(_read(path)):
                bad.append(f"{target}#{anchor}")
    assert not bad, f"{page}: links to sections that do not exist: {bad}"


# The repository's top-level folders a page's path names start with (runs/ is what commands
# write: never checked).
TOP_FOLDERS = (
    "acceptance",
    "benchmarks",
    "configs",
    "data",
    "docs",
    "experiments",
    "realm_jax",
    "tests",
    "tpu",
)
# A repo-relative path anywhere in a page: a top-level folder not preceded by a path's own
# characters (so never inside runs/x/data/, $WORKDIR/data/, gs://b/docs/ or a URL).
_PATH = re.compile(r"(?<![\w./<>$~-])((?:" + "|".join(TOP_FOLDERS) + r")/[\w./-]*)")
# named on purpose although absent, with the reason
ABSENT_ON_PURPOSE = {
    "configs/nope.py": "docs/reliability.md's error table: the missing config file's message",
}


def named_paths(text: str) -> set[str]:
    """The repo-relative paths a page names, in prose, code or links; placeholders (<name>)
    and globs skipped."""
    out = set()
    for m in _PATH.finditer(text):
        path = m.group(1).rstrip(".,:;")
        rest = text[m.end() : m.end() + 1]
        if rest in ("<", "*", "{", "$") or any(c in path for c in "*{}"):
            continue
        out.add(path)
    return out


def test_named_paths_parse():
    text = (
        "see `tests/unit/test_docs.py`, [w](../experiments/world/README.md), realm_jax/qa/. "
        "runs/x/data/sample.txt, $WORKDIR/data/y, gs://b/docs/z, experiments/<name>/README.md, "
        "benchmarks/*.py, https://example.com/tests/a.py"
    )
    assert named_paths(text) == {"tests/unit/test_docs.py", "realm_jax/qa/"}


@pytest.mark.parametrize("page", PAGES + STUDIES)
def test_named_paths_exist(page):
    """Every repo-relative path a page names (tests/..., realm_jax/..., benchmarks/...,
    experiments/..., configs/..., docs/...) exists: a renamed or moved file fails here."""
    missing = sorted(
        p
        for p in named_paths(_read(page))
        if p not in ABSENT_ON_PURPOSE
        and not os.path.exists(os.path.join(REPO, p))
        and not os.path.exists(os.path.join(REPO, os.path.dirname(page), p))
    )
    assert not missing, f"{page}: names paths that do not exist: {missing}"


# Where the metrics the training log, TensorBoard and metrics.json show are computed: each
# key a metrics dict of these files is given ("metrics"/"out"/"speed" = {...}, [...] = ...,
# .update(...), Contribution(metrics={...})) must be defined in docs/glossary.md.
METRIC_SOURCES = (
    "realm_jax/ops/fused_softmax.py",
    "realm_jax/pretrain/step.py",
    "realm_jax/pretrain/measures.py",
    "realm_jax/pretrain/terms.py",
    "realm_jax/pretrain/evaluation.py",
    "realm_jax/pretrain/commands.py",
    "realm_jax/qa/step.py",
    "realm_jax/qa/evaluation.py",
    "realm_jax/qa/commands.py",
    "realm_jax/ict/step.py",
    "realm_jax/ict/evaluation.py",
    "realm_jax/train/state.py",
    "realm_jax/train/instruments.py",
)
_METRIC_DICTS = {"metrics", "out", "speed"}
# arrays the steps and evaluations pass on inside the dict, popped or reduced before logging
NOT_LOGGED = {
    "block_holds",
    "candidate_holds",
    "posterior",
    "prior",
    "query_targets",
    "query_emb",
    "read_ids",
    "read_relevance",
    "retrieved_ids",
}
# f-string keys ({} where the code fills in a value) as the glossary names them
TEMPLATES = {
    "accuracy_block_{}": ("accuracy_block_holds", "accuracy_block_lacks"),
    "doc_in_candidates{}": ("doc_in_candidates", "doc_in_candidates_dense"),
    "span_in_candidates{}": ("span_in_candidates", "span_in_candidates_dense"),
    "goodput/{}": ("goodput/<part>",),
    "grad_norm/{}": ("grad_norm/<network>",),
    "recall@{}": ("recall@k",),
    "title_recall@{}": ("title_recall@k",),
}


def _key(node) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def _is_metrics(node) -> bool:
    return isinstance(node, ast.Name) and node.id in _METRIC_DICTS


def _dict_keys(tree) -> list:
    """The key nodes a module gives its metrics dicts."""
    keys = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if _is_metrics(t) and isinstance(n.value, ast.Dict):
                    keys += n.value.keys
                elif isinstance(t, ast.Subscript) and _is_metrics(t.value):
                    keys.append(t.slice)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            if n.func.attr == "update" and _is_metrics(n.func.value):
                keys += [ast.Constant(k.arg) for k in n.keywords if k.arg]
                keys += [k for a in n.args if isinstance(a, ast.Dict) for k in a.keys]
                keys += [a.key for a in n.args if isinstance(a, ast.DictComp)]
        elif isinstance(n, ast.keyword) and n.arg == "metrics" and isinstance(n.value, ast.Dict):
            keys += n.value.keys
    return keys


def logged_metric_names() -> set[str]:
    """The metric names the code gives, from its metrics dicts (METRIC_SOURCES), the tasks'
    console keys, ICT's evaluation keys, the goodput parts and the progress keys."""
    from realm_jax.pretrain import commands as pretrain
    from realm_jax.qa import commands as qa
    from realm_jax.train import goodput

    keys = [k for path in METRIC_SOURCES for k in _dict_keys(ast.parse(_read(path)))]
    names = {k for k in map(_key, keys) if k is not None} - NOT_LOGGED
    for template, shown in TEMPLATES.items():
        if template in names:
            names = (names - {template}) | set(shown)
    names |= set(pretrain.CONSOLE_KEYS + pretrain.EVAL_CONSOLE_KEYS)
    names |= set(qa.CONSOLE_KEYS + qa.EVAL_CONSOLE_KEYS)
    names |= {"bm25_recall@k", "top1_share", "distinct_top1", "steps_per_sec", "eta_seconds"}
    names |= set(goodput.PARTS) | {"wall"}
    for k in list(names):  # the console keys' k-specific names, as the glossary writes them
        if re.fullmatch(r"(title_)?recall@\d+", k):
            names.discard(k)
            names.add(re.sub(r"\d+$", "k", k))
    return names


def test_metric_templates_known():
    """A new f-string metric key needs its glossary form in TEMPLATES."""
    names = logged_metric_names()
    assert not [n for n in names if "{}" in n], names


def test_the_glossary_defines_every_logged_metric():
    glossary = _read("docs/glossary.md")
    missing = sorted(n for n in logged_metric_names() if f"`{n}`" not in glossary)
    assert not missing, f"docs/glossary.md does not define the logged metrics {missing}"


def test_the_glossary_names_only_metrics_the_code_gives():
    """Each metric the glossary's log section defines (a bullet's leading `names`) is one the
    code still gives: a renamed metric fails here as well as above."""
    text = _read("docs/glossary.md").split("## What the log and metrics.json print", 1)[1]
    defined = set()
    for bullet in re.findall(r"^- (.*?):", text, re.M):
        defined |= set(re.findall(r"`([^`]+)`", bullet.split("(")[0]))
    stale = sorted(defined - logged_metric_names())
    assert not stale, f"docs/glossary.md defines metrics the code no longer gives: {stale}"


SUMMARY = ("Asked", "Ran", "Found", "Command", "When")


@pytest.mark.parametrize("page", STUDIES)
def test_a_study_starts_with_its_summary(page):
    """A study's README opens, under its title, with five lines: what was asked, what was run,
    what was found (with its figure), the command and the date or commit."""
    lines = _read(page).splitlines()
    got = [re.match(r"- \*\*(\w+):\*\* \S", line) for line in lines[2:7]]
    labels = tuple(m.group(1) if m else None for m in got)
    assert lines[0].startswith("# ") and labels == SUMMARY, (
        f"{page}: starts with its title, a blank line and the bullets "
        + ", ".join(f"- **{s}:** ..." for s in SUMMARY)
    )


def test_testing_page_names_test_files_that_exist():
    """docs/testing.md names test files relative to tests/ (`integration/test_plan.py`)."""
    text = _read("docs/testing.md")
    named = set(re.findall(r"`((?:unit|integration|system|experiments)/[\w/]+\.py)", text))
    missing = sorted(p for p in named if not os.path.exists(os.path.join(REPO, "tests", p)))
    assert named and not missing, f"docs/testing.md names test files that do not exist: {missing}"
