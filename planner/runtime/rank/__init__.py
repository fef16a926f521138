"""One rank's executor: its stage module, data, precision, the program interpreter (compute,
transfers, verification and verdicts, gradient sums and the optimizer) and its per-step metrics."""
