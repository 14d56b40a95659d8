"""Benchmarks: ``extproc bench routing`` compares our routing with the peers' policies on
workloads and traces, in the simulator (:mod:`extproc_lab.sim`)."""
