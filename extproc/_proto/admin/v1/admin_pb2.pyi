from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Header(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class ExplainRequest(_message.Message):
    __slots__ = ("headers", "body")
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    headers: _containers.RepeatedCompositeFieldContainer[Header]
    body: bytes
    def __init__(self, headers: _Optional[_Iterable[_Union[Header, _Mapping]]] = ..., body: _Optional[bytes] = ...) -> None: ...

class FilterStep(_message.Message):
    __slots__ = ("filter", "removed", "failed_open")
    FILTER_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    FAILED_OPEN_FIELD_NUMBER: _ClassVar[int]
    filter: str
    removed: _containers.RepeatedCompositeFieldContainer[RemovedReplica]
    failed_open: bool
    def __init__(self, filter: _Optional[str] = ..., removed: _Optional[_Iterable[_Union[RemovedReplica, _Mapping]]] = ..., failed_open: _Optional[bool] = ...) -> None: ...

class RemovedReplica(_message.Message):
    __slots__ = ("replica", "why")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    replica: str
    why: str
    def __init__(self, replica: _Optional[str] = ..., why: _Optional[str] = ...) -> None: ...

class ScorePart(_message.Message):
    __slots__ = ("scorer", "raw", "weight", "contribution")
    SCORER_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    scorer: str
    raw: float
    weight: float
    contribution: float
    def __init__(self, scorer: _Optional[str] = ..., raw: _Optional[float] = ..., weight: _Optional[float] = ..., contribution: _Optional[float] = ...) -> None: ...

class PricePart(_message.Message):
    __slots__ = ("part", "seconds")
    PART_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    part: str
    seconds: float
    def __init__(self, part: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class ReplicaExplanation(_message.Message):
    __slots__ = ("replica", "candidate", "removed_by", "removed_why", "scores", "total", "matched_blocks", "match_source", "predicted_uncached_tokens", "rank", "cache_trust", "cache_evidence_age_s", "kv_events", "predicted_ttft_ms", "predicted_tpot_ms", "price_s", "price_ttft_s", "price_parts", "price_rates")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_FIELD_NUMBER: _ClassVar[int]
    REMOVED_BY_FIELD_NUMBER: _ClassVar[int]
    REMOVED_WHY_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MATCH_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_UNCACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CACHE_TRUST_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVIDENCE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    PRICE_S_FIELD_NUMBER: _ClassVar[int]
    PRICE_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    PRICE_PARTS_FIELD_NUMBER: _ClassVar[int]
    PRICE_RATES_FIELD_NUMBER: _ClassVar[int]
    replica: str
    candidate: bool
    removed_by: str
    removed_why: str
    scores: _containers.RepeatedCompositeFieldContainer[ScorePart]
    total: float
    matched_blocks: int
    match_source: str
    predicted_uncached_tokens: int
    rank: int
    cache_trust: float
    cache_evidence_age_s: float
    kv_events: str
    predicted_ttft_ms: float
    predicted_tpot_ms: float
    price_s: float
    price_ttft_s: float
    price_parts: _containers.RepeatedCompositeFieldContainer[PricePart]
    price_rates: str
    def __init__(self, replica: _Optional[str] = ..., candidate: _Optional[bool] = ..., removed_by: _Optional[str] = ..., removed_why: _Optional[str] = ..., scores: _Optional[_Iterable[_Union[ScorePart, _Mapping]]] = ..., total: _Optional[float] = ..., matched_blocks: _Optional[int] = ..., match_source: _Optional[str] = ..., predicted_uncached_tokens: _Optional[int] = ..., rank: _Optional[int] = ..., cache_trust: _Optional[float] = ..., cache_evidence_age_s: _Optional[float] = ..., kv_events: _Optional[str] = ..., predicted_ttft_ms: _Optional[float] = ..., predicted_tpot_ms: _Optional[float] = ..., price_s: _Optional[float] = ..., price_ttft_s: _Optional[float] = ..., price_parts: _Optional[_Iterable[_Union[PricePart, _Mapping]]] = ..., price_rates: _Optional[str] = ...) -> None: ...

class ExplainResponse(_message.Message):
    __slots__ = ("replica", "reason", "order", "fallbacks", "filters", "replicas", "total_blocks", "matched_blocks", "predicted_uncached_tokens", "pinned", "key_source", "profile", "model", "body_error", "moved_by", "pin_lost", "objective_ttft_ms", "objective_tpot_ms", "objective_predicted", "on_miss", "objective_why", "prefill", "pair_reason", "transfer_blocks", "conversation", "session")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    FILTERS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_UNCACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    KEY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BODY_ERROR_FIELD_NUMBER: _ClassVar[int]
    MOVED_BY_FIELD_NUMBER: _ClassVar[int]
    PIN_LOST_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_PREDICTED_FIELD_NUMBER: _ClassVar[int]
    ON_MISS_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_WHY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    PAIR_REASON_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    replica: str
    reason: str
    order: _containers.RepeatedScalarFieldContainer[str]
    fallbacks: _containers.RepeatedScalarFieldContainer[str]
    filters: _containers.RepeatedCompositeFieldContainer[FilterStep]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaExplanation]
    total_blocks: int
    matched_blocks: int
    predicted_uncached_tokens: int
    pinned: str
    key_source: str
    profile: str
    model: str
    body_error: str
    moved_by: str
    pin_lost: str
    objective_ttft_ms: float
    objective_tpot_ms: float
    objective_predicted: str
    on_miss: str
    objective_why: str
    prefill: str
    pair_reason: str
    transfer_blocks: int
    conversation: str
    session: str
    def __init__(self, replica: _Optional[str] = ..., reason: _Optional[str] = ..., order: _Optional[_Iterable[str]] = ..., fallbacks: _Optional[_Iterable[str]] = ..., filters: _Optional[_Iterable[_Union[FilterStep, _Mapping]]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaExplanation, _Mapping]]] = ..., total_blocks: _Optional[int] = ..., matched_blocks: _Optional[int] = ..., predicted_uncached_tokens: _Optional[int] = ..., pinned: _Optional[str] = ..., key_source: _Optional[str] = ..., profile: _Optional[str] = ..., model: _Optional[str] = ..., body_error: _Optional[str] = ..., moved_by: _Optional[str] = ..., pin_lost: _Optional[str] = ..., objective_ttft_ms: _Optional[float] = ..., objective_tpot_ms: _Optional[float] = ..., objective_predicted: _Optional[str] = ..., on_miss: _Optional[str] = ..., objective_why: _Optional[str] = ..., prefill: _Optional[str] = ..., pair_reason: _Optional[str] = ..., transfer_blocks: _Optional[int] = ..., conversation: _Optional[str] = ..., session: _Optional[str] = ...) -> None: ...

class ListReplicasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("name", "address", "health", "health_penalties", "in_rotation", "rotation_state", "cordon", "inflight", "queue", "kv_usage", "sessions_pinned", "kv_events", "pending_prefill_tokens", "scrape_failures", "cache_trust", "role")
    class HealthPenaltiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    HEALTH_PENALTIES_FIELD_NUMBER: _ClassVar[int]
    IN_ROTATION_FIELD_NUMBER: _ClassVar[int]
    ROTATION_STATE_FIELD_NUMBER: _ClassVar[int]
    CORDON_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_PINNED_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCRAPE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    CACHE_TRUST_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    health: float
    health_penalties: _containers.ScalarMap[str, float]
    in_rotation: bool
    rotation_state: str
    cordon: str
    inflight: int
    queue: int
    kv_usage: float
    sessions_pinned: int
    kv_events: str
    pending_prefill_tokens: int
    scrape_failures: int
    cache_trust: float
    role: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., health: _Optional[float] = ..., health_penalties: _Optional[_Mapping[str, float]] = ..., in_rotation: _Optional[bool] = ..., rotation_state: _Optional[str] = ..., cordon: _Optional[str] = ..., inflight: _Optional[int] = ..., queue: _Optional[int] = ..., kv_usage: _Optional[float] = ..., sessions_pinned: _Optional[int] = ..., kv_events: _Optional[str] = ..., pending_prefill_tokens: _Optional[int] = ..., scrape_failures: _Optional[int] = ..., cache_trust: _Optional[float] = ..., role: _Optional[str] = ...) -> None: ...

class ListReplicasResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaInfo]
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaInfo, _Mapping]]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("session_key", "model")
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    session_key: str
    model: str
    def __init__(self, session_key: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class SessionReply(_message.Message):
    __slots__ = ("session_key", "model", "replica", "forgotten")
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    session_key: str
    model: str
    replica: str
    forgotten: bool
    def __init__(self, session_key: _Optional[str] = ..., model: _Optional[str] = ..., replica: _Optional[str] = ..., forgotten: _Optional[bool] = ...) -> None: ...

class ReplicaRequest(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: str
    def __init__(self, replica: _Optional[str] = ...) -> None: ...

class CordonReply(_message.Message):
    __slots__ = ("replica", "cordon", "sessions_moved")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    CORDON_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_MOVED_FIELD_NUMBER: _ClassVar[int]
    replica: str
    cordon: str
    sessions_moved: int
    def __init__(self, replica: _Optional[str] = ..., cordon: _Optional[str] = ..., sessions_moved: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("sample_rate",)
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    sample_rate: float
    def __init__(self, sample_rate: _Optional[float] = ...) -> None: ...

class DecisionEvent(_message.Message):
    __slots__ = ("time", "replica", "reason", "model", "matched_blocks", "total_blocks", "decision_ms", "skipped", "prefill", "pair_reason")
    TIME_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECISION_MS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    PAIR_REASON_FIELD_NUMBER: _ClassVar[int]
    time: float
    replica: str
    reason: str
    model: str
    matched_blocks: int
    total_blocks: int
    decision_ms: float
    skipped: int
    prefill: str
    pair_reason: str
    def __init__(self, time: _Optional[float] = ..., replica: _Optional[str] = ..., reason: _Optional[str] = ..., model: _Optional[str] = ..., matched_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., decision_ms: _Optional[float] = ..., skipped: _Optional[int] = ..., prefill: _Optional[str] = ..., pair_reason: _Optional[str] = ...) -> None: ...

class ListHotKeysRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HotKeyInfo(_message.Message):
    __slots__ = ("key", "requests_per_second", "mean_prompt_tokens", "replicas", "hot_for_s", "warm_ready")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    MEAN_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    HOT_FOR_S_FIELD_NUMBER: _ClassVar[int]
    WARM_READY_FIELD_NUMBER: _ClassVar[int]
    key: str
    requests_per_second: float
    mean_prompt_tokens: float
    replicas: int
    hot_for_s: float
    warm_ready: bool
    def __init__(self, key: _Optional[str] = ..., requests_per_second: _Optional[float] = ..., mean_prompt_tokens: _Optional[float] = ..., replicas: _Optional[int] = ..., hot_for_s: _Optional[float] = ..., warm_ready: _Optional[bool] = ...) -> None: ...

class ListHotKeysResponse(_message.Message):
    __slots__ = ("enabled", "hot_keys", "cooling")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    HOT_KEYS_FIELD_NUMBER: _ClassVar[int]
    COOLING_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    hot_keys: _containers.RepeatedCompositeFieldContainer[HotKeyInfo]
    cooling: int
    def __init__(self, enabled: _Optional[bool] = ..., hot_keys: _Optional[_Iterable[_Union[HotKeyInfo, _Mapping]]] = ..., cooling: _Optional[int] = ...) -> None: ...

class UsageRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("tenant", "model", "input_tokens", "cached_input_tokens", "output_tokens", "estimated_tokens")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model: str
    input_tokens: int
    cached_input_tokens: int
    output_tokens: int
    estimated_tokens: int
    def __init__(self, tenant: _Optional[str] = ..., model: _Optional[str] = ..., input_tokens: _Optional[int] = ..., cached_input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., estimated_tokens: _Optional[int] = ...) -> None: ...

class BudgetWindow(_message.Message):
    __slots__ = ("window", "limit", "used", "remaining", "reset_s")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    RESET_S_FIELD_NUMBER: _ClassVar[int]
    window: str
    limit: float
    used: float
    remaining: float
    reset_s: float
    def __init__(self, window: _Optional[str] = ..., limit: _Optional[float] = ..., used: _Optional[float] = ..., remaining: _Optional[float] = ..., reset_s: _Optional[float] = ...) -> None: ...

class BudgetUsage(_message.Message):
    __slots__ = ("kind", "name", "windows")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    windows: _containers.RepeatedCompositeFieldContainer[BudgetWindow]
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., windows: _Optional[_Iterable[_Union[BudgetWindow, _Mapping]]] = ...) -> None: ...

class UsageResponse(_message.Message):
    __slots__ = ("enabled", "since", "usage", "budgets")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    BUDGETS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    since: float
    usage: _containers.RepeatedCompositeFieldContainer[TenantUsage]
    budgets: _containers.RepeatedCompositeFieldContainer[BudgetUsage]
    def __init__(self, enabled: _Optional[bool] = ..., since: _Optional[float] = ..., usage: _Optional[_Iterable[_Union[TenantUsage, _Mapping]]] = ..., budgets: _Optional[_Iterable[_Union[BudgetUsage, _Mapping]]] = ...) -> None: ...

class HitRatioRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HitRatioRow(_message.Message):
    __slots__ = ("pool", "replica", "prompt_blocks", "offered_blocks", "captured_blocks", "engine_queries_tokens", "engine_hits_tokens")
    POOL_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFERED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CAPTURED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_QUERIES_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_HITS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    replica: str
    prompt_blocks: int
    offered_blocks: int
    captured_blocks: int
    engine_queries_tokens: float
    engine_hits_tokens: float
    def __init__(self, pool: _Optional[str] = ..., replica: _Optional[str] = ..., prompt_blocks: _Optional[int] = ..., offered_blocks: _Optional[int] = ..., captured_blocks: _Optional[int] = ..., engine_queries_tokens: _Optional[float] = ..., engine_hits_tokens: _Optional[float] = ...) -> None: ...

class HitRatioResponse(_message.Message):
    __slots__ = ("since", "rows")
    SINCE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    since: float
    rows: _containers.RepeatedCompositeFieldContainer[HitRatioRow]
    def __init__(self, since: _Optional[float] = ..., rows: _Optional[_Iterable[_Union[HitRatioRow, _Mapping]]] = ...) -> None: ...
