"""Corpus preparation (TFDS array_record), salient span masking and the grain input pipeline."""
