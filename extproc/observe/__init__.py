"""What the router shows of itself: Prometheus metrics (:mod:`.metrics`), the sampled decision
feed (:mod:`.decisions`), decision spans over OTLP (:mod:`.tracing`) and the hot-key detector
(:mod:`.hotkeys`)."""
