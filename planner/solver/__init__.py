"""The solver: one search for the stage partition, device placement and verifier placement.

Three wings under one orchestrator (``api``): ``search/`` finds plans (baselines, the
uniform pp x dp grids, DPs over the chain, local search), ``bound/`` proves lower bounds
(fluid LP, Lagrangian sequence DP, cap boxes, branching), ``cpsat/`` is the CP-SAT model.
They share the core: ``problem`` (cost tables), ``solution`` (the result), ``objective``
and ``program_cost`` (what a placement's compiled programs cost), ``routing``, ``verifiers``.
"""
