"""The ``kv_events:`` section of the router's config (its schema: :mod:`extproc.config_schema`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from extproc.kvevents.hashing import HashAlgo


@dataclass(frozen=True, slots=True)
class KvEventSettings:
    """Where KV events come from and how blocks are keyed.

    Events are read from a replica when it has a ``kv_events`` endpoint (its ``--replica ...,
    kv_events=tcp://HOST:PORT[,kv_replay=tcp://HOST:PORT]`` labels, or the ``kv_events``,
    ``kv_replay`` and ``kv_dp`` keys of its ``replicas:`` entry), from every discovered replica
    when ``port`` is set (its address with that port; ``replay_port`` likewise), and from every
    replica that connects to ``listen``. They are used for requests to a model with a tokenizer.
    """

    listen: str | None = None
    port: int | None = None
    replay_port: int | None = None
    hash_algo: HashAlgo = HashAlgo.SHA256
    """The engines' ``--prefix-caching-hash-algo`` (sha256, sha256_cbor), or ``content`` when it
    cannot be reproduced (xxhash, or a random seed). Between sha256 and sha256_cbor, what the
    engines report in ``vllm:cache_config_info`` wins."""
    hash_seed: str | None = None
    """The engines' PYTHONHASHSEED, if they set one."""
    block_size: int = 16
    """Tokens per block until the engines report theirs (``vllm:cache_config_info``, the events'
    ``block_size``): a default, what they report wins (:mod:`extproc.kvevents.layout`)."""
    data_parallel_size: int = 1
    """Engines behind each replica's address (vLLM ``--data-parallel-size``): rank r publishes on the
    kv_events port + r (a replica's ``kv_dp`` label overrides it)."""
    stale_after_s: float = 5.0
    speculative_ttl_s: float = 2.0
    replay_timeout_s: float = 1.0
    max_blocks_per_replica: int = 1_000_000
    check_sample_rate: float = 0.1
    """Share of requests whose response body is read for ``usage.prompt_tokens_details.cached_tokens``
    to check the index's prediction (0: never; Envoy is then never asked for a response body)."""
    stale_after_mispredictions: int = 4
    """A replica's feed whose last this many checked predictions disagreed with what the replica
    reported is treated as stale (the estimate answers for it) until its predictions agree again or
    it resyncs (0: never)."""
    unpin_below: float = 0.5
    """A pin keeps its full value while its replica's events show it holding at least this fraction
    of the prompt's blocks; below it the pin is judged lost and is worth what the replica still
    holds, at least the session scorer's ``floor`` (0: pins are never judged lost)."""
    tokenizers: Mapping[str, str] = field(default_factory=dict)
    """Model name -> a directory with tokenizer.json and tokenizer_config.json."""
    lora_adapters: Mapping[str, str] = field(default_factory=dict)
    """LoRA adapter name (as requests name it) -> its base model. vLLM puts the adapter's name into
    every block's hash, so its requests are tokenized with the base's tokenizer, hashed with the
    name as extra key and matched in the base model's index."""

    def resolve(self, model: str) -> tuple[str, str | None]:
        """A requested model as (the model whose tokenizer and index serve it, its LoRA name or None)."""
        base = self.lora_adapters.get(model)
        return (model, None) if base is None else (base, model)

    @property
    def enabled(self) -> bool:
        """Whether any model is tokenized (without a tokenizer, events cannot be matched)."""
        return bool(self.tokenizers)
