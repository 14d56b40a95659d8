"""Config ``kv_events:``: where KV events come from and how blocks are keyed."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from extproc.base.validation import Section, option
from extproc.fleet.kvevents.hashing import HashAlgo
from extproc.fleet.kvevents.tiers import TierWeights

_ENDPOINT = r"^[a-z]+://."


class KvEventSettings(Section):
    """``kv_events:``: vLLM's KV-cache events, matched for models with a tokenizer (docs/kv-events.md).

    Events are read from a replica when it has a ``kv_events`` endpoint (its ``--replica ...,
    kv_events=tcp://HOST:PORT[,kv_replay=tcp://HOST:PORT]`` labels, or the ``kv_events``,
    ``kv_replay`` and ``kv_dp`` keys of its ``replicas:`` entry), from every discovered replica
    when ``port`` is set (its address with that port; ``replay_port`` likewise), and from every
    replica that connects to ``listen``. They are used for requests to a model with a tokenizer.

    ``hash_algo``: between sha256 and sha256_cbor, what the engines report in
    ``vllm:cache_config_info`` wins. ``block_size``: a default, what the engines report (the
    events' ``block_size``) wins (:mod:`extproc.fleet.kvevents.layout`). ``data_parallel_size``: rank r
    publishes on the port + r (a replica's ``kv_dp`` label overrides it). ``unpin_below``: a pin
    keeps its full value while its replica's events show it holding at least this fraction of the
    prompt's blocks; below it the pin is worth what the replica still holds, at least the session
    scorer's ``floor``; a block an offloading connector holds in CPU memory or on storage counts
    as held there. ``cpu_weight``, ``storage_weight``: what such a block is worth in a match
    against one on the GPU (the defaults are llm-d's CPU weight and Dynamo's disk weight).
    ``lora_adapters``: vLLM puts the adapter's name into every block's hash, so its requests are
    tokenized with the base's tokenizer, hashed with the name as extra key and matched in the base
    model's index.
    """

    listen: str | None = option(
        None, "bind one SUB endpoint replicas connect to (tcp://0.0.0.0:5557, ipc://...)", pattern=_ENDPOINT
    )
    port: int | None = option(None, "discovered replicas publish on this port", ge=1, le=65535)
    replay_port: int | None = option(None, "discovered replicas answer replays on this port", ge=1, le=65535)
    # Not strict: the file names the algorithm by its value.
    hash_algo: Annotated[HashAlgo, Field(strict=False)] = option(
        HashAlgo.SHA256, "the engines' --prefix-caching-hash-algo; content when not reproducible (xxhash)"
    )
    hash_seed: str | None = option(None, "the engines' PYTHONHASHSEED, if they set one")
    block_size: int = option(16, "the engines' block size in tokens until they report theirs", ge=1)
    data_parallel_size: int = option(
        1, "engines per replica (--data-parallel-size): rank r publishes on port + r", ge=1
    )
    stale_after_s: float = option(5.0, "a feed silent this long while serving falls back", ge=0.01)
    speculative_ttl_s: float = option(2.0, "a decision credits its blocks this long", ge=0)
    replay_timeout_s: float = option(1.0, "an unanswered replay fails: the replica is cleared", ge=0.01)
    max_blocks_per_replica: int = option(1_000_000, "indexed blocks kept per replica", ge=1)
    check_sample_rate: float = option(
        0.1, "share of responses read for usage.cached_tokens to check predictions (0: never)", ge=0, le=1
    )
    stale_after_mispredictions: int = option(
        4, "wrong checked predictions in a row that make a feed stale (0: never)", ge=0
    )
    unpin_below: float = option(
        0.5, "below this share of the prompt held (on any tier), its events judge a pin lost", ge=0, le=1
    )
    cpu_weight: float = option(
        TierWeights().cpu, "a block held only in CPU memory (medium CPU) counts this much of a GPU one", ge=0, le=1
    )
    storage_weight: float = option(
        TierWeights().storage, "a block held only on storage (medium STORAGE, or another) counts this much", ge=0, le=1
    )
    tokenizers: dict[str, str] = option({}, "model name -> directory with tokenizer.json, tokenizer_config.json")
    lora_adapters: dict[str, str] = option({}, "LoRA adapter name -> its base model (hashed with the name, as vLLM)")

    @field_validator("hash_seed", mode="before")
    @classmethod
    def _seed_as_text(cls, value: object) -> object:
        # PYTHONHASHSEED is an environment variable: a number in the file means its text.
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    def resolve(self, model: str) -> tuple[str, str | None]:
        """A requested model as (the model whose tokenizer and index serve it, its LoRA name or None)."""
        base = self.lora_adapters.get(model)
        return (model, None) if base is None else (base, model)

    @property
    def tier_weights(self) -> TierWeights:
        """The tiers' weights as the index takes them."""
        return TierWeights(self.cpu_weight, self.storage_weight)

    @property
    def enabled(self) -> bool:
        """Whether any model is tokenized (without a tokenizer, events cannot be matched)."""
        return bool(self.tokenizers)
