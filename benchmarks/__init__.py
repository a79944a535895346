"""Benchmarks: the product's figures. Each script measures one thing realm-jax does (a train
step's throughput, retrieval, refresh, prepare at scale, a pod plan, the peer comparison with
HuggingFace's REALM) and writes its own section of docs/benchmarks.md through
`benchmarks._report.write_section`; `make bench` runs the cheap ones (run_all.py), the rest are
run by hand or by their own make target, as each docstring says. A benchmark is never a timed
test: tests may check a benchmark's arithmetic, never assert a speed.
"""
