"""The local gateway: Envoy, the processor and fake replicas on loopback, and a workload replayed."""
