"""How long a replica takes: named capacity and speed profiles for the replica model.

The model (:mod:`extproc_lab.replica.model`) runs in *steps*, as vLLM's engine does: each step
computes a batch of tokens (chunks of prompts being prefilled, one token for each sequence
being decoded) and its duration is

- a step with prefill work: ``ttft_overhead_s + prefill tokens / prefill_tokens_per_s`` plus the
  attention over earlier context (``prefill_s_per_token_pair`` per pair of new and earlier
  token), plus ``decode_s_per_seq`` for each sequence decoding in the same step and
  ``decode_s_per_kv_token`` for each token of context those sequences read;
- a step with decode work only: ``decode_s_per_token`` (the step of a batch of one) plus
  ``decode_s_per_seq`` for each further sequence and ``decode_s_per_kv_token`` per context token.

So time to first token grows with the *uncached* prompt tokens (a prefix-cache hit is a faster
first token), and a decode step grows with the batch and its context. All figures are in
"profile seconds"; ``time_scale`` maps them to wall-clock seconds for the HTTP replica (0.1 runs
ten times faster), so a demo can be quick while its metrics still read as the profile describes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplicaProfile:
    """Capacity and speed of one replica.

    ``block_size`` (tokens per KV block) and ``num_gpu_blocks`` size the KV cache, as vLLM's
    ``--block-size`` and its profiled GPU block count do. ``max_running`` bounds the sequences in
    the running batch (vLLM's ``--max-num-seqs``) and ``max_num_batched_tokens`` the tokens one step
    computes (``--max-num-batched-tokens``); with ``chunked_prefill`` a prompt longer than what is
    left of that budget is prefilled over several steps (vLLM V1 always does this), without it a
    prompt waits for a step with room for all of it (vLLM V0's default).
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
    max_num_batched_tokens: int = 2048
    chunked_prefill: bool = True
    decode_s_per_seq: float = 0.0
    decode_s_per_kv_token: float = 0.0
    prefill_s_per_token_pair: float = 0.0
    kv_transfer_s_per_block: float = 0.0
    """Time to pull one KV block from a prefill replica (disaggregated serving), per block."""
    cpu_offload_blocks: int = 0
    """KV blocks in CPU memory behind the GPU's (vLLM's offloading connector,
    :mod:`extproc_lab.replica.offload`); 0: none."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_gpu_blocks < 1 or self.max_running < 1:
            raise ValueError("block_size, num_gpu_blocks and max_running must be at least 1")
        if self.prefill_tokens_per_s <= 0 or self.time_scale <= 0:
            raise ValueError("prefill_tokens_per_s and time_scale must be positive")
        if self.ttft_overhead_s < 0 or self.decode_s_per_token < 0 or self.default_output_tokens < 1:
            raise ValueError("overheads must not be negative and default_output_tokens must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if (
            min(
                self.decode_s_per_seq,
                self.decode_s_per_kv_token,
                self.prefill_s_per_token_pair,
                self.kv_transfer_s_per_block,
            )
            < 0
        ):
            raise ValueError("per-sequence and per-token costs must not be negative")

    def prefill_seconds(self, uncached_tokens: int) -> float:
        """Profile seconds of a step that prefills ``uncached_tokens`` with nothing else to do
        (and no earlier context): the time to first token of a prompt on an idle replica."""
        n = max(0, uncached_tokens)
        return self.ttft_overhead_s + n / self.prefill_tokens_per_s + self.prefill_s_per_token_pair * n * n / 2

    def step_seconds(
        self, prefill_tokens: int, token_pairs: float, has_prefill: bool, seqs: int, kv_tokens: int
    ) -> float:
        """Profile seconds of one step: ``prefill_tokens`` computed for prompts (``has_prefill`` also
        when a fully cached prompt only needs its first token), ``token_pairs`` new-by-earlier token
        pairs of attention among them, and ``seqs`` sequences decoding one token each over
        ``kv_tokens`` tokens of context."""
        per_kv = self.decode_s_per_kv_token * kv_tokens
        if has_prefill:
            return (
                self.ttft_overhead_s
                + prefill_tokens / self.prefill_tokens_per_s
                + self.prefill_s_per_token_pair * token_pairs
                + self.decode_s_per_seq * seqs
                + per_kv
            )
        if seqs == 0:
            return 0.0
        return self.decode_s_per_token + self.decode_s_per_seq * (seqs - 1) + per_kv

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
    # A prompt is prefilled in one step (no chunking) and a step holds one demo document, so
    # prompts queued together get their first tokens one prefill apart, as the demo shows.
    max_num_batched_tokens=2048,
    chunked_prefill=False,
    # Decode slows a little with the batch (0.1 ms per further sequence), not with context.
    decode_s_per_seq=0.0001,
    # A 2,000-token prompt's 125 blocks cross in 25 ms: a transfer is visible but cheaper than its prefill.
    kv_transfer_s_per_block=0.0002,
)
"""Quick figures for demos and tests: cache hits are visible, answers come back in ~0.1-0.3 s."""

LLAMA_8B_H100 = ReplicaProfile(
    name="llama-8b-h100",
    block_size=16,
    # Llama-3.1-8B in bf16 needs 128 KiB of KV per token (32 layers x 8 KV heads x 128 dims x
    # 2 (K and V) x 2 bytes, from the model's config.json); with --gpu-memory-utilization 0.9 on an
    # 80 GB H100, about 54 GB is left for KV after 16 GB of weights and activations: ~440k tokens,
    # ~27.5k blocks of 16 (GIE's prefix scorer sizes its per-server LRU the same way: 31,250).
    num_gpu_blocks=27_545,
    # Prefill is compute-bound: ~16 GFLOP per token (2 x 8.03e9 parameters); at about a third of the
    # H100 SXM's 989 dense bf16 TFLOP/s that is 20k tokens/s, which is also what the seeds' figure
    # implies (a 10,000-token follow-up took 500 ms uncached).
    prefill_tokens_per_s=20_000.0,
    # Every step reads the 16 GB of weights once: ~8 ms at ~2 TB/s achieved of the 3.35 TB/s HBM3.
    ttft_overhead_s=0.008,
    # Attention of a new token over earlier context: 4 x 32 layers x 4,096 = 0.5 MFLOP per token
    # pair, at about 35% of peak for FlashAttention: 1.5 ns per pair (a 12k-token prompt adds
    # ~0.1 s, an 85k-token one ~5 s, on top of the linear term).
    prefill_s_per_token_pair=1.5e-9,
    # A decode step of one sequence: the weight read plus ~2 ms of scheduling and sampling, 10 ms
    # (publicly reported inter-token latencies of 8B models on one H100 are ~10-15 ms at moderate
    # batch); each further sequence adds its ~16 GFLOP (~0.05 ms) and each token of context read
    # 128 KiB at ~2.2 TB/s (60 ns): a batch of 32 at 4k tokens of context takes ~19 ms.
    decode_s_per_token=0.010,
    decode_s_per_seq=5e-5,
    decode_s_per_kv_token=6e-8,
    default_output_tokens=256,
    # vLLM's defaults for its OpenAI server on GPUs with >= 70 GiB other than A100
    # (vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults): 8,192 batched tokens, 1,024 seqs;
    # the V1 engine always chunks prefills.
    max_running=1024,
    max_num_batched_tokens=8192,
    chunked_prefill=True,
    # A 16-token block is 2 MiB of KV (16 x 128 KiB); NIXL over a 400 Gb/s RDMA link moves
    # ~20 GB/s of it in practice: ~0.1 ms a block (a 10k-token prompt's 625 blocks in ~60 ms).
    kv_transfer_s_per_block=1e-4,
)
"""Approximate Llama-3.1-8B-Instruct on one H100 80GB SXM (bf16, vLLM V1 defaults), for capacity
planning and the routing benchmark.

The figures are derived from the model's shape and the GPU's datasheet with stated efficiencies,
cross-checked against public reports; they are approximations, not measurements.
"""

LLAMA_8B_A100 = dataclasses.replace(
    LLAMA_8B_H100,
    name="llama-8b-a100",
    # The same model and KV cache size (80 GB, bf16) on an A100 SXM: 312 dense bf16 TFLOP/s against
    # the H100's 989 (prefill and attention a third as fast at the same efficiency), 2.0 TB/s of
    # HBM2e against 3.35 (each step's weight and context reads 1.7 times as long).
    prefill_tokens_per_s=6_500.0,
    ttft_overhead_s=0.013,
    prefill_s_per_token_pair=4.5e-9,
    decode_s_per_token=0.016,
    decode_s_per_seq=1.5e-4,
    decode_s_per_kv_token=1.0e-7,
)
"""The same as :data:`LLAMA_8B_H100` on an A100 80GB: a slower replica for mixed pools (derived the
same way, from the datasheets; an approximation, not a measurement)."""

INSTANT = ReplicaProfile(
    name="instant",
    block_size=16,
    num_gpu_blocks=65_536,
    prefill_tokens_per_s=1e12,
    ttft_overhead_s=0.0,
    decode_s_per_token=0.0,
    default_output_tokens=1,
    max_running=100_000,
    max_num_batched_tokens=1 << 30,
)
"""No model time at all: one output token, at once. For measuring what the gateway itself adds."""

PROFILES: dict[str, ReplicaProfile] = {p.name: p for p in (DEMO, LLAMA_8B_H100, LLAMA_8B_A100, INSTANT)}
"""Profiles by name, as picked on the command line."""


def get_profile(name: str, time_scale: float | None = None) -> ReplicaProfile:
    """The profile called ``name``, at ``time_scale`` when given; ``ValueError`` names the known ones."""
    try:
        profile = PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown replica profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
    return profile if time_scale is None else profile.scaled(time_scale)
