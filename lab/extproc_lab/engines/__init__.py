"""Real engines for the lab: vLLM's CPU build in a venv of its own, a locally built model, and a
fleet of engines on loopback (:class:`~extproc_lab.engines.fleet.VllmFleet`)."""
