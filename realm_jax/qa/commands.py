"""Open-domain QA commands: fine-tuning and exact-match evaluation (not built yet)."""

from __future__ import annotations

import sys


def _not_yet(command: str, what: str) -> int:
    print(
        f"realm-jax {command}: {what} is not implemented yet (see README 'Known gaps').",
        file=sys.stderr,
    )
    return 3


def finetune(config, args) -> int:
    return _not_yet("finetune", "open-domain QA fine-tuning")


def evaluate(config, args) -> int:
    return _not_yet("evaluate", "exact-match evaluation")
