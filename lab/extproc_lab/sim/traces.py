"""Loaders for the production traces shipped in ``lab/extproc_lab/sim/data/traces``, turned into workloads.

- **Mooncake** (kvcache-ai/Mooncake FAST'25, Apache-2.0): one JSON object per line with
  ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``, ids of 512-token
  blocks chained over the prefix (two requests share k blocks exactly when their first k ids are
  equal). Each id becomes a deterministic 2,048-character block of text, so equal ids give equal
  text and the router hashes them as it would hash real prompts; the replica model keys its cache
  by the ids themselves (one key per 512 tokens, which keeps the simulator fast).
- **Azure LLM inference 2023** (Azure/AzurePublicDataset, CC-BY-4.0, Splitwise ISCA'24): CSV
  ``TIMESTAMP,ContextTokens,GeneratedTokens``, arrivals and lengths only; every prompt gets text
  of its own (no shared prefix).

The traces ship with the package (their licences and origins beside them, in ``MANIFEST.md``);
``--traces-dir`` or ``$EXTPROC_TRACES_DIR`` points at another copy.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import random
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import xxhash

from extproc.api import CHARS_PER_TOKEN
from extproc.api.sim import model_seed
from extproc_lab.sim.workload import DEFAULT_MODEL, SimRequest, Workload

TRACES_ENV = "EXTPROC_TRACES_DIR"
MOONCAKE_BLOCK_TOKENS = 512
ROUTER_BLOCK_CHARS = 64
TRACE_FILES = {
    "mooncake-conversation": "mooncake_conversation_trace.jsonl.gz",
    "mooncake-synthetic": "mooncake_synthetic_trace.jsonl.gz",
    "azure-conv": "azure_llm_2023_conv.csv.gz",
    "azure-code": "azure_llm_2023_code.csv.gz",
}

_xxh3 = xxhash.xxh3_64_intdigest


PACKAGED_TRACES = Path(__file__).resolve().parent / "data" / "traces"
"""The traces installed with the package."""


def traces_dir(override: str | Path | None = None) -> Path:
    """Where the traces are: ``override``, else ``$EXTPROC_TRACES_DIR``, else the packaged copy."""
    if override:
        return Path(override)
    env = os.environ.get(TRACES_ENV)
    if env:
        return Path(env)
    return PACKAGED_TRACES


def trace_path(name: str, override: str | Path | None = None) -> Path:
    """The file of the named trace; a missing one is an error that says where it was looked for."""
    path = traces_dir(override) / TRACE_FILES[name]
    if not path.is_file():
        raise FileNotFoundError(
            f"trace {name!r} not found at {path}; the package ships it in {PACKAGED_TRACES / TRACE_FILES[name]} "
            f"(a checkout has it under lab/extproc_lab/sim/data/traces; MANIFEST.md there says where it came from). "
            f"Point --traces-dir or ${TRACES_ENV} at a directory holding {TRACE_FILES[name]}, or unset them."
        )
    return path


def _open_text(path: Path) -> Iterator[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        yield from f


# --- Mooncake ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MooncakeRecord:
    """One line of a Mooncake trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_mooncake(path: str | Path, limit: int | None = None) -> list[MooncakeRecord]:
    """Read a Mooncake JSONL trace (gzipped or not); at most ``limit`` records."""
    out: list[MooncakeRecord] = []
    for line in _open_text(Path(path)):
        if not line.strip():
            continue
        raw = json.loads(line)
        out.append(
            MooncakeRecord(
                int(raw["timestamp"]),
                int(raw["input_length"]),
                int(raw["output_length"]),
                tuple(int(h) for h in raw["hash_ids"]),
            )
        )
        if limit is not None and len(out) >= limit:
            break
    return out


_WORDS = (
    "the of and to in is that for it as with was on be by this are from or at an which have not "
    "river mountain garden window letter market harbor engine signal winter summer autumn spring "
    "cache replica token prefix session model request latency block memory route gateway queue"
).split()


def _filler(seed: int, chars: int) -> str:
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < chars:
        w = rng.choice(_WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:chars]


_POOL = _filler(20240915, 8192)


class BlockText:
    """Deterministic text for trace blocks, and the router's hashes of it, memoised by block.

    Block ``k`` of ``chars`` characters is ``<k>`` followed by filler taken from a fixed pool at an
    offset given by ``k``: equal ids give equal text, different ids differ from their first
    characters. Hashes are chained over 64-character blocks exactly as
    :func:`extproc.api.sim.block_hashes` chains them over the whole prompt, so they are
    computed once per trace block (512 tokens = 32 router blocks) and shared by every request
    with that prefix.
    """

    def __init__(self, model: str = DEFAULT_MODEL, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> None:
        self.seed = model_seed(model)
        self.block_chars = block_tokens * CHARS_PER_TOKEN
        self._memo: dict[tuple[int, int], bytes] = {}

    def block(self, block_id: int, chars: int) -> str:
        """The text of one trace block."""
        head = f"<{block_id}>"
        offset = (block_id * 7919) % (len(_POOL) - self.block_chars)
        return (head + _POOL[offset : offset + self.block_chars])[:chars]

    def _sizes(self, ids: tuple[int, ...], tokens: int) -> list[int]:
        """Characters of each block of a prompt of ``tokens`` tokens."""
        total = tokens * CHARS_PER_TOKEN
        sizes = []
        for i in range(len(ids)):
            left = total - i * self.block_chars
            if left <= 0:
                break
            sizes.append(min(self.block_chars, left))
        return sizes

    def text(self, ids: tuple[int, ...], tokens: int) -> str:
        """The whole prompt."""
        return "".join(self.block(b, c) for b, c in zip(ids, self._sizes(ids, tokens), strict=False))

    def hashes(self, ids: tuple[int, ...], tokens: int, max_blocks: int) -> tuple[int, ...]:
        """The router's prefix hashes of :meth:`text` (64-character blocks, at most ``max_blocks``)."""
        out = bytearray()
        want = max_blocks * 8
        prev = self.seed
        memo = self._memo
        for block_id, chars in zip(ids, self._sizes(ids, tokens), strict=False):
            if len(out) >= want:
                break
            packed = memo.get((block_id, chars))
            if packed is None:
                data = self.block(block_id, chars).encode()
                hs = array("Q")
                h = prev
                for i in range(chars // ROUTER_BLOCK_CHARS):
                    h = _xxh3(data[i * ROUTER_BLOCK_CHARS : (i + 1) * ROUTER_BLOCK_CHARS], h)
                    hs.append(h)
                packed = hs.tobytes()
                memo[(block_id, chars)] = packed
            if packed:
                prev = int.from_bytes(packed[-8:], "little")
            out += packed
        return tuple(array("Q", bytes(out[:want])).tolist())


def _trace_keys(ids: tuple[int, ...], tokens: int, block_tokens: int) -> tuple[tuple[int, ...], int]:
    """The replica keys of a trace prompt (its block ids, full 16-token blocks only) and the
    tokens its last key covers."""
    n = min(len(ids), math.ceil(tokens / block_tokens))
    if n == 0:
        return (), block_tokens
    tail = (tokens - block_tokens * (n - 1)) // 16 * 16
    if tail == 0:
        n -= 1
        tail = block_tokens
    return ids[:n], min(tail, block_tokens)


def mooncake_workload(
    records: list[MooncakeRecord], name: str, rate: float = 1.0, model: str = DEFAULT_MODEL
) -> Workload:
    """A workload replaying Mooncake records; ``rate`` speeds arrivals up (2.0 = twice as dense)."""
    text = BlockText(model)
    t0 = records[0].timestamp_ms if records else 0
    reqs = []
    for i, rec in enumerate(records):
        keys, tail = _trace_keys(rec.hash_ids, rec.input_length, MOONCAKE_BLOCK_TOKENS)
        reqs.append(
            SimRequest(
                index=i,
                arrival_s=(rec.timestamp_ms - t0) / 1000.0 / rate,
                prompt_tokens=max(1, rec.input_length),
                output_tokens=max(1, rec.output_length),
                keys=keys,
                key_span=MOONCAKE_BLOCK_TOKENS,
                tail_span=tail,
                model=model,
                router_hashes=partial(text.hashes, rec.hash_ids, rec.input_length),
                synth_text=partial(text.text, rec.hash_ids, rec.input_length),
            )
        )
    span = (records[-1].timestamp_ms - t0) / 1000.0 / rate if records else 0.0
    return Workload(
        name, reqs, {"source": "Mooncake FAST'25 trace (Apache-2.0)", "rate": rate, "span_s": round(span, 1)}
    )


# --- Azure ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AzureRecord:
    """One row of an Azure LLM inference trace: seconds since the first row, and token counts."""

    t_s: float
    context_tokens: int
    generated_tokens: int


def _seconds(stamp: str) -> float:
    """``2023-11-16 18:15:46.6805900`` -> seconds since the epoch of that day's calendar (UTC-less)."""
    date, _, clock = stamp.strip().partition(" ")
    y, mo, d = (int(x) for x in date.split("-"))
    h, mi, s = clock.split(":")
    days = (y * 372 + mo * 31 + d) * 86400  # monotone in the date; only differences are used
    return days + int(h) * 3600 + int(mi) * 60 + float(s)


def load_azure(path: str | Path, limit: int | None = None) -> list[AzureRecord]:
    """Read an Azure LLM inference CSV (gzipped or not); at most ``limit`` rows."""
    out: list[AzureRecord] = []
    t0: float | None = None
    lines = _open_text(Path(path))
    header = next(lines, "")
    if not header.startswith("TIMESTAMP"):
        raise ValueError(f"{path}: expected a TIMESTAMP,ContextTokens,GeneratedTokens header, got {header[:60]!r}")
    for line in lines:
        if not line.strip():
            continue
        stamp, context, generated = line.rsplit(",", 2)
        t = _seconds(stamp)
        t0 = t if t0 is None else t0
        out.append(AzureRecord(t - t0, int(context), int(generated)))
        if limit is not None and len(out) >= limit:
            break
    return out


def azure_workload(records: list[AzureRecord], name: str, rate: float = 1.0, model: str = DEFAULT_MODEL) -> Workload:
    """A workload replaying Azure rows: arrivals and lengths, every prompt unique."""
    text = BlockText(model)
    reqs = []
    for i, rec in enumerate(records):
        tokens = max(1, rec.context_tokens)
        # Negative ids of their own: no two requests (and no trace ids) share a block.
        ids = tuple(-(i * 4096 + j + 1) for j in range(math.ceil(tokens / MOONCAKE_BLOCK_TOKENS)))
        keys, tail = _trace_keys(ids, tokens, MOONCAKE_BLOCK_TOKENS)
        reqs.append(
            SimRequest(
                index=i,
                arrival_s=rec.t_s / rate,
                prompt_tokens=tokens,
                output_tokens=max(1, rec.generated_tokens),
                keys=keys,
                key_span=MOONCAKE_BLOCK_TOKENS,
                tail_span=tail,
                model=model,
                router_hashes=partial(text.hashes, ids, tokens),
                synth_text=partial(text.text, ids, tokens),
            )
        )
    span = records[-1].t_s / rate if records else 0.0
    return Workload(
        name, reqs, {"source": "Azure LLM inference trace 2023 (CC-BY-4.0)", "rate": rate, "span_s": round(span, 1)}
    )


def load_trace_workload(
    path: str | Path, rate: float = 1.0, limit: int | None = None, name: str | None = None
) -> Workload:
    """A workload from a trace file of either format (told apart by its first line)."""
    p = Path(path)
    first = next(_open_text(p), "")
    label = name or p.name.split(".")[0]
    if first.lstrip().startswith("{"):
        return mooncake_workload(load_mooncake(p, limit), label, rate)
    return azure_workload(load_azure(p, limit), label, rate)
