"""The error of corpus input that cannot be read, below every reader of it.

data/corpus.py (our line files and folders) and the foreign-format readers of interop/ (the
release's block records, REALM's annotated shards) raise CorpusError or a subclass of it, so
`realm-jax prepare` reports any of them as one line (cli.EXPECTED_ERRORS). It sits with the
foundations because interop/ sits below data/: the readers cannot import data/corpus.py.
"""

# How a CLI user skips bad documents (read_documents(skip_bad_input=True) in code).
SKIP_HINT = "--config.data.skip_bad_input=true skips and counts such input"


class CorpusError(ValueError):
    """Malformed corpus input; the message names the file and line."""
