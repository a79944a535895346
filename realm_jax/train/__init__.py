"""What every task shares: optimizer, state, warm start, metrics and the one loop."""
