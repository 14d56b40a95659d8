"""How long a fake replica takes: named timing and capacity profiles.

The model is deliberately small. Time to first token is a fixed overhead plus the *uncached*
prompt tokens divided by the prefill rate, so a prefix-cache hit shows up as a faster first
token; every further output token costs a fixed decode step. All figures are in "profile
seconds"; ``time_scale`` maps them to wall-clock seconds (0.1 runs ten times faster), so a demo
can be quick while the metrics still read as the profile describes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplicaProfile:
    """Capacity and speed of one fake replica.

    ``block_size`` (tokens per KV block) and ``num_gpu_blocks`` size the prefix cache, as vLLM's
    ``--block-size`` and the profiled GPU block count do. ``max_running`` bounds concurrent
    running requests (vLLM's ``--max-num-seqs``); requests beyond it wait.
    """

    name: str
    block_size: int
    num_gpu_blocks: int
    prefill_tokens_per_s: float
    ttft_overhead_s: float
    decode_s_per_token: float
    default_output_tokens: int
    max_running: int
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_gpu_blocks < 1 or self.max_running < 1:
            raise ValueError("block_size, num_gpu_blocks and max_running must be at least 1")
        if self.prefill_tokens_per_s <= 0 or self.time_scale <= 0:
            raise ValueError("prefill_tokens_per_s and time_scale must be positive")
        if self.ttft_overhead_s < 0 or self.decode_s_per_token < 0 or self.default_output_tokens < 1:
            raise ValueError("overheads must not be negative and default_output_tokens must be at least 1")

    def prefill_seconds(self, uncached_tokens: int) -> float:
        """Profile seconds from the start of a prefill to the first token."""
        return self.ttft_overhead_s + max(0, uncached_tokens) / self.prefill_tokens_per_s

    def decode_seconds(self, tokens: int) -> float:
        """Profile seconds to decode ``tokens`` output tokens after the first one."""
        return max(0, tokens) * self.decode_s_per_token

    def scaled(self, time_scale: float) -> ReplicaProfile:
        """This profile running at another speed (1.0 = real time, 0.1 = ten times faster)."""
        return dataclasses.replace(self, time_scale=time_scale)


DEMO = ReplicaProfile(
    name="demo",
    block_size=16,
    # 1,024 blocks = 16k tokens: a demo replays a few dozen conversations, not the thousands a
    # real fleet holds, so the cache is scaled down with it: a replica holds about half of the
    # demo's working set, as a real replica holds a fraction of its fleet's.
    num_gpu_blocks=1024,
    # 2,000 uncached tokens take 0.2 s; a fully cached prompt costs only the 3 ms overhead.
    prefill_tokens_per_s=10_000.0,
    ttft_overhead_s=0.003,
    decode_s_per_token=0.005,
    default_output_tokens=16,
    max_running=64,
)
"""Quick figures for demos and tests: cache hits are visible, answers come back in ~0.1-0.3 s."""

LLAMA_8B_H100 = ReplicaProfile(
    name="llama-8b-h100",
    block_size=16,
    # Llama-3.1-8B in bf16 needs 128 KiB of KV per token (32 layers x 8 KV heads x 128 dims x
    # 2 (K and V) x 2 bytes); with --gpu-memory-utilization 0.9 on an 80 GB H100, about 54 GB is
    # left for KV after weights and activations: ~430k tokens, ~27.5k blocks of 16.
    num_gpu_blocks=27_545,
    # Round public figures, approximations only: an 8B model prefills roughly 10k-20k tokens/s
    # on one H100 (about 16 GFLOP per token at 15-30% of ~990 dense bf16 TFLOP/s) ...
    prefill_tokens_per_s=15_000.0,
    ttft_overhead_s=0.02,
    # ... and decodes at ~10-15 ms per output token per request at a moderate batch (tens of
    # concurrent sequences), where decode is bound by reading the weights and the KV cache.
    decode_s_per_token=0.012,
    default_output_tokens=256,
    # vLLM's long-standing default --max-num-seqs.
    max_running=256,
)
"""Approximate Llama-3.1-8B-Instruct on one H100 80GB (bf16, vLLM defaults), for capacity planning.

The figures are round approximations of publicly reported numbers, not measurements: prefill
~15k tokens/s (reported range roughly 10k-20k), decode ~12 ms/token at moderate batch (~10-15 ms),
and a KV-cache size derived from the model's shape and the GPU's memory. Decode time does not grow
with batch size in this model, so it is optimistic under heavy load.
"""

INSTANT = ReplicaProfile(
    name="instant",
    block_size=16,
    num_gpu_blocks=65_536,
    prefill_tokens_per_s=1e12,
    ttft_overhead_s=0.0,
    decode_s_per_token=0.0,
    default_output_tokens=1,
    max_running=100_000,
)
"""No model time at all: one output token, at once. For measuring what the gateway itself adds."""

PROFILES: dict[str, ReplicaProfile] = {p.name: p for p in (DEMO, LLAMA_8B_H100, INSTANT)}
"""Profiles by name, as picked on the command line."""


def get_profile(name: str, time_scale: float | None = None) -> ReplicaProfile:
    """The profile called ``name``, at ``time_scale`` when given; ``ValueError`` names the known ones."""
    try:
        profile = PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown replica profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
    return profile if time_scale is None else profile.scaled(time_scale)
