"""Token budgets: tokens per minute and per day for a tenant, an API key or a model, charged from
the usage replicas report.

Platforms meter in tokens, not requests. A budget limits a weighted total of the tokens used
(``weights``: input, cached input and output tokens each count for their weight; a cached token is
cheaper to serve than one prefilled) over fixed windows, a minute and a day, that reset on the
clock's boundaries. A budget belongs to a subject: a tenant (``tenants``), an API key (``keys``:
the ``Authorization`` bearer token, known by its SHA-256 digest only) or a model (``models``, over
every tenant's requests for it). A request is charged to every subject that applies to it and is
admitted while each has room for its estimated prompt tokens on top of what is charged and what
its requests in flight have reserved, so the tightest limit decides and a burst overshoots by at
most the requests in flight. Over budget: 429 with ``Retry-After`` (seconds to the refusing
window's end) and OpenAI's ``x-ratelimit-*-tokens`` headers.

Where the counts live is a :class:`BudgetStore`: process memory for one gateway, Redis for several
(one round trip for every subject of a request). The ledger never raises for its store: a store
that fails degrades to this gateway's own counts, never to no limit and never to refusing everyone.

Its parts: :mod:`.settings` (the ``budgets:`` section), :mod:`.ledger` (admission, reservations,
charges), :mod:`.stores` (where the counts live).
"""

from extproc.state.budgets.ledger import FREE, Admission, BudgetLedger, BudgetStanding, WindowStanding
from extproc.state.budgets.settings import (
    KEY_PREFIX,
    MODEL_PREFIX,
    WINDOWS,
    BudgetSettings,
    KeyBudget,
    SubjectKind,
    TokenBudget,
    TokenWeights,
)
from extproc.state.budgets.stores import BudgetStore, MemoryBudgetStore, window_start

__all__ = [
    "FREE",
    "KEY_PREFIX",
    "MODEL_PREFIX",
    "WINDOWS",
    "Admission",
    "BudgetLedger",
    "BudgetSettings",
    "BudgetStanding",
    "BudgetStore",
    "KeyBudget",
    "MemoryBudgetStore",
    "SubjectKind",
    "TokenBudget",
    "TokenWeights",
    "WindowStanding",
    "window_start",
]
