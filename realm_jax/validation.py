"""One validation of what a user asks a trained workdir, for every entry point: the Python API
(api.py: load, retrieve, answer, embed_queries, embed_blocks) and the CLI's `ask` and
`evaluate`. Each problem is one InputError (a ValueError; InputTypeError, a wrong type, is a
TypeError too) with one clear message, which the CLI prints as one line and exits 2
(cli.EXPECTED_ERRORS). Nothing here imports JAX or orbax."""

from __future__ import annotations

import numbers

RETRIEVERS = ("dense", "bm25", "hybrid")  # the API's and `ask`'s; `evaluate` adds gold
CHECKPOINT_NAMES = ("best", "latest")


class InputError(ValueError):
    """A question, k, retriever or checkpoint that the workdir cannot be asked with."""


class InputTypeError(InputError, TypeError):
    """An argument of the wrong type (bytes for a question, a float or bool for k)."""


def _kind(value) -> str:
    return type(value).__name__


def question(text, what: str = "question") -> str:
    """A non-empty string (not bytes, not whitespace only), returned as given."""
    if isinstance(text, (bytes, bytearray)):
        raise InputTypeError(
            f"{what} must be a str, got {_kind(text)} {bytes(text)[:40]!r}: decode it first "
            "(text.decode('utf-8'))"
        )
    if not isinstance(text, str):
        raise InputTypeError(f"{what} must be a str, got {_kind(text)} {text!r:.60}")
    if not text.strip():
        raise InputError(f"{what} is empty{' (whitespace only)' if text else ''}: give some text")
    return text


def questions(given, what: str = "question") -> tuple[list[str], bool]:
    """(the questions as a list, whether a single string was given): a string, or a list
    (tuple, any iterable but a mapping) of at least one string, each checked by question()."""
    if isinstance(given, str):
        return [question(given, what)], True
    if isinstance(given, (bytes, bytearray)):
        question(given, what)  # raises, naming bytes
    if isinstance(given, dict) or not hasattr(given, "__iter__"):
        raise InputTypeError(
            f"{what}s must be a str or a list of str, got {_kind(given)} {given!r:.60}"
        )
    out = list(given)
    if not out:
        raise InputError(f"no {what}s: got an empty {_kind(given)}; give at least one {what}")
    return [question(q, f"{what}s[{i}]") for i, q in enumerate(out)], False


def texts(given, what: str = "text") -> list[str]:
    """A string or a non-empty list of strings, each non-empty (embed_blocks' texts)."""
    return questions(given, what)[0]


def top_k(k, name: str = "k") -> int:
    """A positive integer (not a bool, not a float, even 2.0)."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise InputTypeError(f"{name} must be a positive integer, got {_kind(k)} {k!r}")
    if k < 1:
        raise InputError(f"{name} must be at least 1, got {k}")
    return int(k)


def retriever(name, allowed: tuple[str, ...] = RETRIEVERS) -> str:
    """One of `allowed` (dense, bm25, hybrid)."""
    if not isinstance(name, str) or name not in allowed:
        raise InputError(f"retriever must be one of {', '.join(allowed)}; got {name!r}")
    return name


def checkpoint(which, names: tuple[str, ...] = CHECKPOINT_NAMES) -> str | int:
    """One of `names` (best, latest; `evaluate` adds initial) or a step number (an int >= 0 or
    its digits): the name only; whether that step exists is checked against the workdir
    (existing_step)."""
    given = ", ".join(names)
    if isinstance(which, bool):
        raise InputTypeError(f"checkpoint must be {given} or a step number, got {which!r}")
    if isinstance(which, numbers.Integral) and which >= 0:
        return int(which)
    if isinstance(which, str):
        if which in names:
            return which
        if which.strip().isdigit():
            return int(which.strip())
    raise InputError(f"unknown checkpoint {which!r}: give {given} or a step number (an int >= 0)")


def existing_step(step: int, steps, where: str) -> int:
    """`step` when the workdir holds it, else one error listing the steps it does hold."""
    steps = sorted(int(s) for s in steps)
    if step not in steps:
        held = ", ".join(map(str, steps)) if steps else "none"
        raise InputError(
            f"{where} holds no checkpoint {step}: its steps are {held} (or give best, latest)"
        )
    return step
