"""The CP-SAT model of stage partition, placement and verifiers; its hint; its verifier placement."""
