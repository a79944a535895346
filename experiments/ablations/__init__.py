"""A study: experiments/ablations/README.md states its question, result, commit and command."""
