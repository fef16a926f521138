"""The processes of a run: the local launcher, hosts and their ranks, membership proofs, one rank's
life (``worker``), re-planning legs (``elastic``), torchrun's elastic starts and the trained weights' output."""
