"""The lab: what proves the router, kept apart from it.

A fake vLLM replica and the replica model under it (:mod:`extproc_lab.replica`), workloads, traces
and the discrete-event simulator (:mod:`extproc_lab.sim`), the peer routers' policies
(:mod:`extproc_lab.peers`), benchmarks (:mod:`extproc_lab.bench`), and the demo, fault matrix and
soak (:mod:`extproc_lab.demo`). It builds on the router's public API; the router never imports it.
"""
