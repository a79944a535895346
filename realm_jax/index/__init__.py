"""The document index: storage, retention, ScaNN, BM25, the corpus on device, the trainer's
feed, the refresh job, `ask`."""
