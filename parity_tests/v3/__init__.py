"""Needle 3's part of the parity suite: its probe table, batches, loss, depth rungs and tolerance budgets."""
