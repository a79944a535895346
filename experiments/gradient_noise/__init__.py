"""A study: experiments/gradient_noise/README.md states its question, result, commit and command."""
