"""The gateway's subset hint, read from an ext_proc message's metadata (:mod:`extproc.request.subset`
says what it means and how it reaches the decision).

Envoy sends it only when the ext_proc filter forwards the namespace:
``metadata_options: {forwarding_namespaces: {untyped: [envoy.lb.subset_hint]}}``, as the gateways
that implement InferencePool configure it.
"""

from __future__ import annotations

import logging

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.request.subset import SUBSET_FIELD, SUBSET_KEY, SUBSET_NAMESPACE, encode_subset

log = logging.getLogger("extproc.stream")


def subset_hint(request: pb.ProcessingRequest) -> str | None:
    """The hint's endpoints as :data:`~extproc.request.subset.SUBSET_KEY`'s value, None without a
    hint. A list of strings, as the protocol has it (a comma-separated string is taken too); a
    value of another shape offers nothing (the request is answered 503, never routed around it)."""
    if not request.HasField("metadata_context"):
        return None
    namespaces = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in namespaces:
        return None
    fields = namespaces[SUBSET_NAMESPACE].fields
    if SUBSET_FIELD not in fields:
        return None
    value = fields[SUBSET_FIELD]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        entries = [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
        if len(entries) < len(value.list_value.values):
            log.debug("subset hint: entries that are not strings ignored")
        return encode_subset(entries)
    if kind == "string_value":
        return encode_subset(value.string_value.split(","))
    log.debug("subset hint of kind %s: offers no endpoint", kind)
    return ""


def with_subset_hint(headers: dict[str, str], request: pb.ProcessingRequest) -> dict[str, str]:
    """``headers`` with the hint put at :data:`~extproc.request.subset.SUBSET_KEY` (whatever the
    headers held there removed first: only Envoy's metadata sets it)."""
    headers.pop(SUBSET_KEY, None)
    hint = subset_hint(request)
    if hint is not None:
        headers[SUBSET_KEY] = hint
    return headers
