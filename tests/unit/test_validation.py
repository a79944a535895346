"""The one validation of what a trained workdir is asked (realm_jax/validation.py), which the
Python API and the CLI's `ask` and `evaluate` call: each bad question, k, retriever and
checkpoint raises one InputError (a ValueError, so the CLI prints one line and exits 2) with
one clear message. The API's own calls: tests/integration/test_inference_anywhere.py."""

import re

import numpy as np
import pytest

from realm_jax import validation


def test_validation_names_each_bad_argument():
    """validation.py alone (what every entry point calls): the error class and message."""
    assert validation.questions("who?") == (["who?"], True)
    assert validation.questions(("a", "b")) == (["a", "b"], False)
    assert validation.top_k(np.int64(3)) == 3
    assert validation.checkpoint("12") == 12 and validation.checkpoint("best") == "best"
    evaluate = ("best", "latest", "initial")  # evaluate --checkpoint's names
    assert validation.checkpoint("initial", evaluate) == "initial"
    with pytest.raises(validation.InputError, match="give best, latest, initial or a step"):
        validation.checkpoint("first", evaluate)
    with pytest.raises(validation.InputError, match="give best, latest or a step"):
        validation.checkpoint("initial")  # not the API's
    for call, kind, message in (
        (lambda: validation.questions(""), validation.InputError, "question is empty"),
        (lambda: validation.questions(" \n"), validation.InputError, "whitespace only"),
        (lambda: validation.questions([]), validation.InputError, "no questions: got an empty"),
        (lambda: validation.questions(b"who?"), TypeError, "got bytes b'who?': decode it"),
        (lambda: validation.questions(["a", None]), TypeError, "questions[1] must be a str"),
        (lambda: validation.questions(7), TypeError, "a str or a list of str, got int"),
        (lambda: validation.top_k(2.5), TypeError, "k must be a positive integer, got float"),
        (lambda: validation.top_k(2.0), TypeError, "got float 2.0"),
        (lambda: validation.top_k(True), TypeError, "got bool True"),
        (lambda: validation.top_k(0), validation.InputError, "k must be at least 1, got 0"),
        (lambda: validation.retriever("nope"), validation.InputError, "one of dense, bm25"),
        (lambda: validation.checkpoint("nope"), validation.InputError, "unknown checkpoint"),
        (lambda: validation.checkpoint(-1), validation.InputError, "unknown checkpoint -1"),
        (lambda: validation.existing_step(9, [7], "w"), validation.InputError, "steps are 7"),
    ):
        with pytest.raises(kind, match=re.escape(message)) as e:
            call()
        assert isinstance(e.value, ValueError)  # the CLI's one line and exit 2
