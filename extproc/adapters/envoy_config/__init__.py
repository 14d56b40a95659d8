"""Envoy bootstrap configs for the gateway, rendered from the router's replica list.

Every message is built from envoy-data-plane's typed classes (betterproto2 messages that are
pydantic dataclasses), so a misspelt field, a value of the wrong type or an ``Any`` of an unknown
type fails here, at render time, instead of in ``envoy --mode validate`` or, worse, at start-up on
a production gateway. This module is imported by ``extproc envoy-config``, the local gateway and
the tests; the processor's request path never imports it (betterproto2 parsing is about 65 times
slower than the upb messages the servicer uses).

Two modes, one shape: a route taken when our routing header is present, and a default route
(plain round robin over every replica) taken when it is not, so a dead or slow processor
(``failure_mode_allow``) degrades to load balancing instead of 500s. Client-sent routing
headers are stripped before ext_proc runs, so a client never picks its own replica, even when
the processor is down.

- ``cluster``: one Envoy cluster per replica, chosen with ``route.cluster_header``. Each
  replica's cluster also lists every other replica at priority 1: a connect failure or reset
  is retried on another replica (``previous_priorities``), so a dead replica costs no client
  error for requests that had not reached it.
- ``endpoint``: the Gateway API Inference Extension's endpoint-picker protocol: the processor
  names the pod's ``ip:port`` in ``x-gateway-destination-endpoint`` and, with fallbacks, in the
  ``envoy.lb`` metadata. Two cluster kinds read it:
  ``override_host`` (default): a cluster of the known replicas with the ``override_host`` load
  balancing policy, which takes the metadata list, then the header, then round robin; retries
  of connect failures and resets go to another host, so a dead pod costs no client error.
  ``original_dst``: an ``ORIGINAL_DST`` cluster connects to whatever address the header names,
  for fleets Envoy does not know; a retry goes to the same address, so a dead pod's requests
  fail over only after the processor ejects it.

In both modes a routed try has a budget (``per_try_timeout``; a hung replica's requests go
elsewhere in seconds, not at the route timeout): streams marked by the processor take a route
with a first-byte timeout that resets the try and an idle timeout; a non-streaming try's budget,
from its ``max_tokens``, hedges (another replica is asked too, the first try keeps running).
Responses carry ``x-envoy-attempt-count`` and the answering address so the processor learns which
chosen replicas failed their try (:mod:`extproc.base.upstream_timeouts`, ``docs/timeouts.md``).

The typed classes express everything used here. ``Any`` fields (``typed_config``, the
``typed_extension_protocol_options`` map) are filled with ``Any.pack(message)``, whose type URL
comes from envoy-data-plane's message pool, so no ``@type`` string is written by hand; the YAML
form comes back from ``to_dict``, which unpacks each ``Any``. The one thing that is not an Envoy
message is the Istio ``EnvoyFilter`` (a Kubernetes resource): its envelope is a plain mapping,
but every patch value in it (filters, the cluster and listener fields merged) is a typed message.

The scenarios shipped under ``envoy/`` and ``k8s/`` are named presets of :class:`GatewaySpec`
(:data:`SCENARIOS`); :func:`istio_envoy_filter` builds the Istio ``EnvoyFilter`` that inserts the
same filters into an Istio ingress gateway, from the same builders.

One module a job: :mod:`.spec` (what a gateway is made of, and the scenarios), the typed builders
(:mod:`.values`, :mod:`.filters`, :mod:`.listeners`, :mod:`.clusters`, and :mod:`.bootstrap` the
whole), :mod:`.rendering` (to plain data and YAML), :mod:`.istio` (the
EnvoyFilter) and :mod:`.command` (``extproc envoy-config``'s flags).
"""

from extproc.adapters.envoy_config.bootstrap import bootstrap
from extproc.adapters.envoy_config.clusters import processor_cluster
from extproc.adapters.envoy_config.command import run_envoy_config, spec_from_args
from extproc.adapters.envoy_config.filters import ext_proc_filter, header_mutation_filter
from extproc.adapters.envoy_config.istio import IstioSpec, dns_address, istio_envoy_filter
from extproc.adapters.envoy_config.rendering import dump_yaml, render, render_yaml, to_dict
from extproc.adapters.envoy_config.spec import SCENARIOS, GatewaySpec, ProcessorTls, Scenario

__all__ = [
    "SCENARIOS",
    "GatewaySpec",
    "IstioSpec",
    "ProcessorTls",
    "Scenario",
    "bootstrap",
    "dns_address",
    "dump_yaml",
    "ext_proc_filter",
    "header_mutation_filter",
    "istio_envoy_filter",
    "processor_cluster",
    "render",
    "render_yaml",
    "run_envoy_config",
    "spec_from_args",
    "to_dict",
]
