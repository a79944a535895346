"""The networks: BERT layers, REALM's embedders and reader, their inputs (HF weights in and
out: interop/)."""
