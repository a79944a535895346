"""The Inverse Cloze Task (ORQA, Lee et al. 2019): the embedders' warm start for REALM."""
