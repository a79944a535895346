"""REALM pre-training: its held-out evaluation (the step is train_step.py, the task
trainer.py, until the package moves into the DESIGN.md layout)."""
