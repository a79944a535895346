"""The training loop every task shares (REALM pre-training, ICT, ORQA fine-tuning)."""
