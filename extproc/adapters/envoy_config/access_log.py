"""Envoy's access log: a JSON line a request, with where its time went before the replica answered.

Its figures split what a request spends outside the replica: receiving the body, the processor's
answers as Envoy waited for them (the ext_proc filter's own per-message latencies), and the hop to
the replica. A line carries no prompt, no header a client could put a secret in, and no session
key: the method and path, the status, the replica, the request id, and times; Envoy's JSON
formatter escapes every value (a request id a client sent and Envoy kept included).
"""

from __future__ import annotations

from envoy_data_plane.envoy.config.accesslog.v3 import AccessLog
from envoy_data_plane.envoy.config.core.v3 import SubstitutionFormatString
from envoy_data_plane.envoy.extensions.access_loggers.file.v3 import FileAccessLog
from envoy_data_plane.google.protobuf import Any as AnyMessage
from envoy_data_plane.google.protobuf import Struct, Value

from extproc.adapters.envoy_config.spec import EXT_PROC_FILTER, GatewaySpec

FILE_ACCESS_LOG = "envoy.access_loggers.file"

# The *_us fields: microseconds from the first byte Envoy received from the client (DS_RX_BEG).
REQUEST_FIELDS: dict[str, str] = {
    "start": "%START_TIME%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(:PATH)%",
    "status": "%RESPONSE_CODE%",
    "flags": "%RESPONSE_FLAGS%",
    "upstream": "%UPSTREAM_HOST%",
    "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
    "duration_ms": "%DURATION%",
    # The client's whole body arrived.
    "received_us": "%COMMON_DURATION(DS_RX_BEG:DS_RX_END:us)%",
    # The request's first byte left for the replica (after the processor answered, for ours).
    "upstream_sent_us": "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",
    # The replica's response headers came (a vLLM stream's come before its first token).
    "upstream_answered_us": "%COMMON_DURATION(DS_RX_BEG:US_RX_BEG:us)%",
    # The response's first byte left for the client.
    "downstream_answered_us": "%COMMON_DURATION(DS_RX_BEG:DS_TX_BEG:us)%",
}

_EXT_PROC_STATE = (
    "request_header_latency_us",
    "request_body_total_latency_us",
    "request_trailer_latency_us",
    "response_header_latency_us",
    "response_body_call_count",
    "response_body_total_latency_us",
)
PROCESSOR_FIELDS: dict[str, str] = {
    f"ext_proc_{name}": f"%FILTER_STATE({EXT_PROC_FILTER}:FIELD:{name})%" for name in _EXT_PROC_STATE
}
"""What Envoy waited for the processor, by message (the ext_proc filter's logging info)."""


def access_logs(spec: GatewaySpec, with_processor: bool) -> list[AccessLog]:
    """The connection manager's access logs: one JSON line a request to ``spec.access_log``
    (none without it); with the processor's per-message latencies where it is in the chain."""
    if spec.access_log is None:
        return []
    fields = {**REQUEST_FIELDS, **(PROCESSOR_FIELDS if with_processor else {})}
    line = Struct(fields={name: Value(string_value=command) for name, command in fields.items()})
    # Fields with nothing to say (no upstream, no response body read) are left out, not "-".
    log_format = SubstitutionFormatString(json_format=line, omit_empty_values=True)
    config = FileAccessLog(path=spec.access_log, log_format=log_format)
    return [AccessLog(name=FILE_ACCESS_LOG, typed_config=AnyMessage.pack(config))]
