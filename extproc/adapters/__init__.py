"""Adapters: what speaks to the world outside the router. The ext_proc gRPC server
(:mod:`.server`), the admin API and console (:mod:`.admin`), the Envoy configuration it renders
(:mod:`.envoy_config`), the ``extproc`` command (:mod:`.cli`, :mod:`.calibrate`), the Prometheus
page (:mod:`.metrics_http`) and OpenTelemetry's set-up (:mod:`.telemetry`). The top layer: nothing
below imports it."""
