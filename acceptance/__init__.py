"""Acceptance: the product's promises checked end to end through the real CLI, as a user or a pod
would run it: the reliability drills (kill -9 and damaged checkpoints, drills.py), the
bad-input catalogue (every expected error is one clean line, bad_input.py) and the pod
rehearsal (the paper's chain as 2 jax.distributed processes on gs://, pod_rehearsal.py with
pod_stages.py and pod_jobs.py). Each writes its section of docs/reliability.md. Not benchmarks
(no figure of speed is a promise here) and not studies (nothing here asks whether REALM learns).
"""
