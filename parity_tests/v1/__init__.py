"""Needle v1 in the parity suite: its probe table, runs, loss, inputs and tolerance budgets (the adapter is in
parity_tests.v1.adapter, so importing one of these modules does not import the others)."""
