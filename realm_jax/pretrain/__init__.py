"""REALM pre-training: its loss, step, held-out evaluation and the train/local commands."""
