"""Corpus preparation (TFDS array_record), salient span masking and the grain input pipeline.

Write side: prepare (the command; chooses an engine and publishes) over the engines
local_prepare, beam_prepare and release_prepare, which share records (schemas, records,
masking, the eval split). Read side: datasets. Foreign corpus formats are read by interop/."""
