"""Experiments: the studies behind docs/results.md, one folder each (squad_qa, ablations,
realm_signal, gradient_noise, bm25_reader, minilm_reader_gpu), with its script, its config
where it has one, and a README that states the question, the result, the commit and the
command that made it; a study's script writes its result section into that README.
experiments/tools/ holds what several studies use. Nothing in realm_jax or the tests may
depend on a study, and a study is not a benchmark (no product figure) or an acceptance check.
"""
