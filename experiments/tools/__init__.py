"""Tools several studies use: stage stamps that make a multi-stage study resume only on the same
config, code and upstream stages (stage_stamp.py), and the paired comparison of retrievers on
the same questions with its sign test (paired_retrieval.py). Studies import them as
`from experiments.tools import stage_stamp`; nothing here writes a result on its own account.
"""
