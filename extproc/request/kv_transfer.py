"""The request bodies of a disaggregated request's two hops, as vLLM's KV connectors expect them.

vLLM serves a request disaggregated in two hops (its disaggregated-serving proxy drives them):

1. the **prefill hop**: the client's body with one output token, no stream, no ``min_tokens``
   and ``kv_transfer_params: {"do_remote_decode": true}``, to the prefill replica, which answers
   with ``kv_transfer_params`` naming where the prompt's blocks wait (``remote_engine_id``,
   ``remote_block_ids``, ``remote_host``, ``remote_port``);
2. the **decode hop**: the client's body as sent, plus those ``kv_transfer_params``, to the
   decode replica, which pulls the blocks and streams the answer.

Pure functions of the bodies; the hop itself (an HTTP call) is the caller's. A prefill answer
without usable parameters means the decode hop goes without them: the decode replica then
computes the whole prompt (aggregated), which is what vLLM does when a transfer fails.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from extproc.request.openai_body import one_token

PARAMS_FIELD = "kv_transfer_params"
"""The request and response field vLLM's KV connectors read and write."""

PREFILLER_HEADER = "x-prefiller-host-port"
"""llm-d's header naming the prefill replica (``host:port``) to its decode-side sidecar."""


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill hop's body: ``body`` computing its prompt and one token, handing the blocks on."""
    hop = one_token(body)
    hop["stream"] = False
    hop[PARAMS_FIELD] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return hop


def answer_params(answer: bytes | Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a prefill hop's answer (a JSON body or its parsed object), if
    they name remote blocks; None otherwise (an error body, a replica without a connector)."""
    if isinstance(answer, bytes | bytearray):
        try:
            answer = json.loads(answer)
        except ValueError:
            return None
    if not isinstance(answer, Mapping):
        return None
    params = answer.get(PARAMS_FIELD)
    if not isinstance(params, Mapping) or params.get("do_remote_prefill") is not True:
        return None
    if not isinstance(params.get("remote_block_ids"), list):
        return None
    return dict(params)


def decode_body(body: Mapping[str, Any], params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The decode hop's body: the client's ``body`` with the prefill's ``params`` (None: as sent,
    so the decode replica computes the prompt itself)."""
    hop = dict(body)
    if params is None:
        hop.pop(PARAMS_FIELD, None)
    else:
        hop[PARAMS_FIELD] = dict(params)
    return hop


def prefiller_header(address: str) -> tuple[str, str]:
    """The header naming the prefill replica to llm-d's sidecar on the decode replica."""
    return PREFILLER_HEADER, address
