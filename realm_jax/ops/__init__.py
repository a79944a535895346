"""Kernels: the fused vocabulary softmax and sharded exact MIPS."""
