"""Lower bounds on any plan's cost: the fluid LP, the Lagrangian sequence DP, cap boxes and branching."""
