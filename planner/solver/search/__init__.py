"""Plan search: baselines, uniform pp x dp grids, DPs over the chain and over stage sequences, local search."""
