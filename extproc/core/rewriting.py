"""Rewriting a request's body before it is routed: a split's arm (its model replaced), a
Responses request named so that its next turn finds the one replica that stores it."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import replace

from extproc.config import Config
from extproc.request.features import ParsedRequest, with_model, with_response_id
from extproc.request.splits import Arm, choose_arm


def name_response(config: Config, headers: Mapping[str, str], request: ParsedRequest) -> tuple[ParsedRequest, bool]:
    """A Responses request that may be stored and names no ``request_id`` is given one (the id
    vLLM gives its response): its next turn's ``previous_response_id`` then finds its replica,
    the only one that holds the conversation. True when the body changed."""
    assert request.body is not None
    body = request.body.body
    if "request_id" in body or body.get("store") is False:
        return request, False
    return with_response_id(request, f"resp_{uuid.uuid4().hex}", headers, config.features), True


def split(config: Config, headers: Mapping[str, str], request: ParsedRequest) -> tuple[ParsedRequest, Arm | None, bool]:
    """The request's split arm, and whether its body changed: rewritten to the arm's model,
    its features taken again from that body (not parsed again), so the prefix hashes are
    seeded with the model actually served."""
    features, parsed = request.features, request.body
    if parsed is None:
        return request, None, False
    key = features.session_key or parsed.user or features.request_id or None
    arm = choose_arm(config.splits, features.model, headers, key)
    if arm is None:
        return request, None, False
    changed = arm.target.model != features.model
    if changed:
        request = with_model(request, arm.target.model, headers, config.features, hashed=False)
    if arm.target.pool is not None:
        request = ParsedRequest(replace(request.features, pool=(("pool", arm.target.pool),)), request.body)
    return request, arm, changed
