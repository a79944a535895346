"""A study: experiments/realm_signal/README.md states its question, result, commit and command."""
