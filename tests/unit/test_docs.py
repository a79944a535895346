"""Docs that run (issue 47): every command, option, config variant and field, make target and
relative link the user-facing pages name exists in the code. Part of `make check`."""

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


@pytest.mark.parametrize("page", PAGES)
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
