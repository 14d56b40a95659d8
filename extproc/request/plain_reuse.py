"""Reusing the tokens of a plain prompt's opening: completions that start with the same long text.

A chat's rendered template is cut at special tokens, which a tokenizer always splits out
(:mod:`extproc.request.tokenizer`). A completion's prompt usually has none, yet prompts that open
with the same document or instructions are common (vLLM's own benchmark client sends nothing
else), and encoding a few thousand characters afresh was most of the router's own time for such a
request (about 1 ms of 2 in process for 3,000 characters with the lab's model).

The pre-tokenizers of the BPE tokenizers vLLM serves (byte-level, a regex split) cut the text where
their pattern matches, and a match is decided by a bounded look-ahead: so the tokens of a shared
opening, short of its last words, are the same in every prompt that opens with it, and what
follows can be encoded on its own. This is checked, not assumed, for each prompt: the tokens of a
recent prompt with the same first :data:`HEAD_CHARS` characters are kept up to a boundary at least
:data:`MARGIN` characters short of the text the two share; the rest is encoded starting
:data:`WINDOW` characters before that boundary, and taken only when that overlap comes out as the
same tokens ending at the same places. Otherwise the whole prompt is encoded.

The check is not a proof for every tokenizer (a normalizer or pre-tokenizer that looks further
back could pass it and still differ), so every :data:`SAMPLE`-th reuse is also encoded whole and
compared: one difference turns reuse off for that tokenizer, with a warning. A tokenizer that adds
special tokens after a prompt, or truncates or pads, never reuses.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

from tokenizers import Tokenizer

log = logging.getLogger(__name__)

HEAD_CHARS = 256
"""Prompts are looked up by their first this many characters (at least this long to be kept)."""
MIN_CHARS = 1024
"""Shorter prompts are encoded whole: a tenth of a millisecond, less than the bookkeeping saves."""
MARGIN = 64
"""Characters short of the shared text where kept tokens end: its last words may tokenize
differently once the texts part."""
WINDOW = 32
"""Characters encoded again before the boundary, whose tokens must come out the same."""
SAMPLE = 64
"""Every this many reuses, the whole prompt is encoded too and the two compared."""
STORE_CHARS = 1_000_000
"""What the store of recent prompts holds at most, in characters of their text (their token ids
and ends besides: about ten times as much again in memory)."""


def common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (by halving: slices compare in C)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True, slots=True)
class _Encoded:
    text: str
    ids: tuple[int, ...]
    ends: tuple[int, ...]
    """Where each token ends in ``text``, in characters (0 for the leading special tokens)."""


class PlainReuse:
    """A plain prompt encoded with the tokenizer's special tokens, reusing a recent prompt's tokens
    where the two open alike. Thread-safe (prompts are encoded in worker threads)."""

    def __init__(self, tokenizer: Tokenizer, store_chars: int = STORE_CHARS) -> None:
        self.tokenizer = tokenizer
        self._store: OrderedDict[str, _Encoded] = OrderedDict()
        self._store_chars = 0
        self._cap = store_chars
        self._lock = threading.Lock()
        self._reuses = 0
        self.leading = self._leading_specials()
        """How many special tokens the tokenizer puts before a prompt (None: reuse is off)."""

    def _leading_specials(self) -> int | None:
        """Special tokens added before a prompt and none after it; None where it adds any after,
        truncates or pads (the tail encoded alone would then be wrong)."""
        if self.tokenizer.truncation is not None or self.tokenizer.padding is not None:
            return None
        probe = "The probe, 12 words long: reuse is checked against it."
        with_specials = self.tokenizer.encode(probe, add_special_tokens=True).ids
        plain = self.tokenizer.encode(probe, add_special_tokens=False).ids
        lead = len(with_specials) - len(plain)
        if lead < 0 or with_specials[lead:] != plain:
            return None
        return lead

    @property
    def enabled(self) -> bool:
        """Whether prompts reuse (off for a tokenizer that adds special tokens after a prompt, or
        once a sampled comparison found a difference)."""
        return self.leading is not None

    def encode(self, text: str) -> tuple[tuple[int, ...], int]:
        """``text``'s token ids with the tokenizer's special tokens, and how many came from a
        recent prompt."""
        lead = self.leading  # read once: another thread may turn reuse off meanwhile
        if lead is None or len(text) < MIN_CHARS:
            return tuple(self.tokenizer.encode(text, add_special_tokens=True).ids), 0
        key = text[:HEAD_CHARS]
        with self._lock:
            previous = self._store.get(key)
        got = self._reuse(previous, text, lead) if previous is not None else None
        if got is not None and not self._agrees(text, got[0].ids):
            got = None
        encoded, reused = got if got is not None else (self._whole(text), 0)
        with self._lock:
            old = self._store.pop(key, None)
            if old is not None:
                self._store_chars -= len(old.text)
            if len(text) <= self._cap:
                self._store[key] = encoded
                self._store_chars += len(text)
            while self._store_chars > self._cap and self._store:
                _, dropped = self._store.popitem(last=False)
                self._store_chars -= len(dropped.text)
        return encoded.ids, reused

    def unshared(self, text: str) -> int:
        """About how many characters of ``text`` :meth:`encode` would encode: what follows a
        recent prompt's opening, less the margin and window (all of it when none)."""
        if self.leading is None or len(text) < MIN_CHARS:
            return len(text)
        with self._lock:
            previous = self._store.get(text[:HEAD_CHARS])
        if previous is None:
            return len(text)
        return len(text) - max(0, common_prefix(previous.text, text) - MARGIN - WINDOW)

    def _whole(self, text: str) -> _Encoded:
        enc = self.tokenizer.encode(text, add_special_tokens=True)
        return _Encoded(text, tuple(enc.ids), tuple(end for _, end in enc.offsets))

    def _reuse(self, previous: _Encoded, text: str, lead: int) -> tuple[_Encoded, int] | None:
        """``text`` encoded from ``previous``'s tokens up to a checked boundary; None where no
        boundary passes the check (``lead``: the special tokens before a prompt)."""
        ends, old = previous.ends, previous.text
        limit = common_prefix(old, text) - MARGIN
        # The boundary that ends the overlap, and the one it starts at: each the end of a token
        # whose last character is not a space (a space may be left out of a token's recorded end).
        # Bisect takes ends as never decreasing (so in every tokenizer tried); where they would, it
        # may pick another boundary, and the checks below still hold it within the shared text.
        k = self._exact_boundary(old, ends, bisect.bisect_right(ends, limit), lead)
        if k is None or ends[k - 1] > limit:
            return None
        j = self._exact_boundary(old, ends, bisect.bisect_right(ends, ends[k - 1] - WINDOW, 0, k), lead)
        if j is None or j >= k:
            return None
        start = ends[j - 1]
        tail = self.tokenizer.encode(text[start:], add_special_tokens=False)
        overlap = k - j
        ids, offsets = tail.ids, tail.offsets
        if len(ids) < overlap or tuple(ids[:overlap]) != previous.ids[j:k]:
            return None
        if any(start + offsets[i][1] != ends[j + i] for i in range(overlap)):
            return None
        return (
            _Encoded(text, previous.ids[:j] + tuple(ids), ends[:j] + tuple(start + end for _, end in offsets)),
            j,
        )

    @staticmethod
    def _exact_boundary(text: str, ends: tuple[int, ...], k: int, lead: int) -> int | None:
        """The largest ``i <= k`` past the leading special tokens whose token ``i - 1`` ends on a
        character other than a space (None: none)."""
        while k > lead and (ends[k - 1] <= 0 or text[ends[k - 1] - 1].isspace()):
            k -= 1
        return k if k > lead else None

    def _agrees(self, text: str, ids: tuple[int, ...]) -> bool:
        """Every :data:`SAMPLE`-th reuse, whether encoding ``text`` whole gives ``ids``; on the
        first difference reuse is turned off for good."""
        with self._lock:
            self._reuses += 1
            sampled = self._reuses % SAMPLE == 1
        if not sampled:
            return True
        whole = tuple(self.tokenizer.encode(text, add_special_tokens=True).ids)
        if whole == ids:
            return True
        self.leading = None
        log.warning(
            "a prompt's reused tokens differ from encoding it whole (%d against %d tokens): prompts "
            "with a shared opening are encoded whole from now on for this tokenizer",
            len(ids),
            len(whole),
        )
        return False
