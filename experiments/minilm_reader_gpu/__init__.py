"""A study: experiments/minilm_reader_gpu/README.md states its question, result, commit, command."""
