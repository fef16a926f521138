"""What a run reports: per-step progress lines and metrics at rank 0, the run's result and report."""
