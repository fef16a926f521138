"""The profiler and its probes: the only code that times hardware.

``profile`` measures this machine (matmul rates, per-block times, memory) and, through
``planner.runtime.rank.p2p_probe`` (the side that talks to peers), the point-to-point link
between local processes; ``overhead_probe`` the runtime's own cost per pass and message.
Results are JSON files that ``cost_models`` reads.
"""
