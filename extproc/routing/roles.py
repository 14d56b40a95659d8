"""A replica's part in disaggregated serving, read from its labels as llm-d labels its pods.

llm-d's guides deploy prefill and decode pods of one model side by side and tell them apart by
the pod label ``llm-d.ai/role``: ``prefill``, ``decode``, or ``both`` for a pod that serves
whole requests (aggregated; some of llm-d's components also write ``prefill-decode``). A replica
without the label serves whole requests, as every replica did before disaggregation.

Why a pair is what it is (:class:`PairReason`) lives here, beside the roles, so that the decision
(:class:`~extproc.routing.model.Decision`) can carry it without importing the pair's module.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

ROLE_LABEL = "llm-d.ai/role"
"""The label naming a replica's role (llm-d's pod label)."""


class Role(enum.StrEnum):
    """What a replica does with a request."""

    PREFILL = "prefill"
    """Computes prompts and hands their KV blocks on; serves no decode."""
    DECODE = "decode"
    """Generates tokens, from blocks it holds or receives; may prefill short prompts itself."""
    BOTH = "both"
    """Serves whole requests (aggregated), and either hop of a disaggregated one."""

    @property
    def prefills(self) -> bool:
        """Whether it may take a request's prefill hop."""
        return self is not Role.DECODE

    @property
    def decodes(self) -> bool:
        """Whether it may take a request's decode (or a whole request)."""
        return self is not Role.PREFILL


_ALIASES = {"prefill-decode": Role.BOTH, "": Role.BOTH}


def role_of(labels: Mapping[str, str]) -> Role:
    """The role ``labels`` give (``ROLE_LABEL``); an absent or unknown value serves whole requests."""
    value = labels.get(ROLE_LABEL, "").strip().lower()
    alias = _ALIASES.get(value)
    if alias is not None:
        return alias
    try:
        return Role(value)
    except ValueError:
        return Role.BOTH


class PairReason(enum.StrEnum):
    """Why a pair is what it is (a metric label: keep the set small)."""

    DISAGGREGATED = "disaggregated"
    """Prefilled on one replica, decoded on another."""
    SHORT = "short"
    """The prompt is below the threshold: aggregated on the decode replica."""
    HELD = "held"
    """The decode replica holds all but fewer than the threshold's tokens: aggregated there."""
    LOCAL = "local"
    """The decode replica would finish what it lacks of the prompt as soon as any prefill replica."""
    NO_PREFILLER = "no_prefiller"
    """No other replica may prefill: aggregated on the decode replica."""
    NO_DECODER = "no_decoder"
    """No candidate may decode: no pair."""
