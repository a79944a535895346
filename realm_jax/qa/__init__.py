"""Open-domain QA: ORQA fine-tuning, evaluation, the BM25 baseline."""
