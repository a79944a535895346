"""A study: experiments/squad_qa/README.md states its question, result, commit and command."""
