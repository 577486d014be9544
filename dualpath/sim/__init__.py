"""Cluster-scale discrete-event simulator and P/D planner (pure: no torch, no engine code).

It drives the real scheduler (:mod:`dualpath.scheduler`) with simulated clocks, links and
compute, so the paper's clusters can be studied on one CPU. See :mod:`dualpath.sim.cluster`.
"""
