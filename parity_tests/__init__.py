"""parity_tests: the twin-parity engine (probes, metrics, tolerances, reports) and the pytest suite built on it."""
