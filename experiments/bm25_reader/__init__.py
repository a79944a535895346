"""A study: experiments/bm25_reader/README.md states its question, result, commit and command."""
