"""Tokenizing prompts as vLLM does, so the router can compute the engine's own block hashes.

A model's tokenizer is a directory holding ``tokenizer.json`` and ``tokenizer_config.json`` (its
``chat_template`` and special tokens), read with the ``tokenizers`` library. For
``/v1/chat/completions`` the chat template is rendered as vLLM renders it (through Hugging Face's
``apply_chat_template``: a sandboxed jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``,
``add_generation_prompt``) and the text is encoded without adding special tokens; for
``/v1/completions`` the prompt is encoded with them.

Incremental where it is safe: a session's next turn usually re-sends the last turn's text and
adds to it. Tokens never straddle a special token (added tokens are split out before the model
runs), so everything up to the last special token the new text shares with the text already
tokenized is reused and only the rest is encoded again. The text already tokenized is the
session's previous turn, else the last prompt that opened with the same head (its text through
the first special token past :data:`HEAD_CHARS` characters: a shared system prompt, say), kept in
a store bounded by characters: requests of different sessions, or of none, that share a long
system prompt tokenize it once. A prompt encoded with its special tokens (a completion's) has no
such cuts: :mod:`extproc.request.plain_reuse` reuses a recent prompt's tokens where a check says
it is safe.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from extproc.request.plain_reuse import PlainReuse, common_prefix

HEAD_CHARS = 256
"""A prompt's head, the key of the store of recent prompts: its text through the first special
token that ends at or past this many characters (short heads would make every prompt one key)."""
HEAD_STORE_CHARS = 4_000_000
"""What the store of recent prompts by head holds at most, in characters of their text (their
token ids besides: about as many again in memory)."""


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be used, or a request it cannot render."""


@dataclass(frozen=True, slots=True)
class Tokenized:
    """A prompt's rendered text and token ids."""

    text: str
    ids: tuple[int, ...]
    reused: int = 0
    """How many leading tokens came from a previous prompt (the session's turn, a same head's)."""


def _token_str(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _raise(message: str) -> None:
    raise TokenizerError(message)


def _message_content(content: Any) -> Any:
    # vLLM hands templates that expect a string the text parts joined by newlines.
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type", "text") == "text"]
        if len(texts) != len(content):
            raise TokenizerError("media parts are not tokenized here")
        return "\n".join(t for t in texts if isinstance(t, str))
    return content


class PromptTokenizer:
    """One model's tokenizer and chat template."""

    def __init__(
        self, directory: str | Path, session_cache: int = 4096, head_store_chars: int = HEAD_STORE_CHARS
    ) -> None:
        path = Path(directory)
        try:
            self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:
            raise TokenizerError(f"{path}: no usable tokenizer.json ({exc})") from None
        config: dict[str, Any] = {}
        config_path = path / "tokenizer_config.json"
        if config_path.exists():
            try:
                config = json.loads(config_path.read_text())
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"{config_path}: {exc}") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: vLLM uses "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        self.specials = {
            key: s for key in ("bos_token", "eos_token", "unk_token", "pad_token") if (s := _token_str(config.get(key)))
        }
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, sort_keys=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(template) if isinstance(template, str) else None
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"{path}: chat template does not compile ({exc})") from None
        # Boundaries that are safe to cut at: special added tokens that do not eat whitespace.
        decoder = self.tokenizer.get_added_tokens_decoder()
        self._cut_ids = {
            i: t.content
            for i, t in decoder.items()
            if t.special and not t.lstrip and not t.rstrip and not t.single_word and not t.normalized
        }
        self._cut_tokens = sorted(set(self._cut_ids.values()))
        self.merges_inline_system = self._takes_only_a_leading_system()
        """Whether the template refuses a system message after the first turn: then vLLM's
        ``/v1/messages`` merges inline system messages into the leading one, and so does the router."""
        self._sessions: OrderedDict[str, Tokenized] = OrderedDict()
        self._session_cap = session_cache
        # Recent prompts by head (a shared system prompt is tokenized once), bounded by characters.
        # Off where one cut token is inside another: counting cuts in the text would then be ambiguous.
        self._heads: OrderedDict[str, Tokenized] | None = OrderedDict()
        if any(a != b and a in b for a in self._cut_tokens for b in self._cut_tokens):
            self._heads = None
        self._head_chars = 0
        self._head_cap = head_store_chars
        self._lock = threading.Lock()
        self.plain = PlainReuse(self.tokenizer)
        """Completions (and Responses) prompts: a recent prompt's tokens reused where checked."""

    def _takes_only_a_leading_system(self) -> bool:
        """vLLM's probe: a system, user, system, user conversation rendered (no generation prompt);
        a template that raises on it (a ``loop.first`` guard) takes only a leading system message."""
        if self.template is None:
            return True
        probe = [{"role": r, "content": "t"} for r in ("system", "user", "system", "user")]
        try:
            self.template.render(messages=probe, add_generation_prompt=False)
        except TokenizerError:
            return True
        except Exception:  # a template can raise anything on odd input
            return True
        return False

    def render_chat(self, messages: Sequence[Any], tools: Any = None) -> str:
        """The chat template's text for ``messages`` with the generation prompt added."""
        if self.template is None:
            raise TokenizerError("the tokenizer has no chat template")
        msgs = []
        for m in messages:
            if not isinstance(m, Mapping):
                raise TokenizerError("a message is not an object")
            msg = dict(m)
            if "content" in msg:
                msg["content"] = _message_content(msg["content"])
            msgs.append(msg)
        try:
            return self.template.render(
                messages=msgs, tools=tools, add_generation_prompt=True, **self.specials
            )  # fmt: skip
        except TokenizerError:
            raise
        except Exception as exc:  # a template can raise anything on odd input
            raise TokenizerError(f"chat template failed: {type(exc).__name__}: {exc}") from None

    def encode(self, text: str, add_special_tokens: bool, session: str | None = None) -> Tokenized:
        """Token ids of ``text``; with ``session``, reusing what its previous turn tokenized, else
        (or where that shares less) what a recent prompt with the same head did."""
        if add_special_tokens:  # a prompt that starts with added tokens (completions): no special-token cuts
            ids, reused = self.plain.encode(text)
            return Tokenized(text, ids, reused=reused)
        head = self._head(text)
        previous = by_head = None
        with self._lock:
            if session is not None:
                previous = self._sessions.get(session)
            if head is not None and self._heads is not None:
                by_head = self._heads.get(head)
        result = self._encode_from(text, previous, by_head)
        with self._lock:
            if session is not None:
                self._sessions[session] = result
                self._sessions.move_to_end(session)
                while len(self._sessions) > self._session_cap:
                    self._sessions.popitem(last=False)
            if head is not None and self._heads is not None and len(text) <= self._head_cap:
                self._keep_head(head, result)
        return result

    def unshared(self, text: str, session: str | None = None) -> int:
        """How many characters of ``text`` (a chat's rendered template) :meth:`encode` would encode
        afresh: what follows the last special token it shares with the session's previous turn or
        a recent prompt of the same head (all of it when none)."""
        head = self._head(text)
        with self._lock:
            previous = self._sessions.get(session) if session is not None else None
            by_head = self._heads.get(head) if head is not None and self._heads is not None else None
        cut = max((self._safe_cut(p, text)[0] for p in (previous, by_head) if p is not None), default=0)
        return len(text) - cut

    def _head(self, text: str) -> str | None:
        """The text through the first cut token ending at or past :data:`HEAD_CHARS` (None: none)."""
        end = -1
        for token in self._cut_tokens:
            at = text.find(token, max(0, HEAD_CHARS - len(token)))
            if at >= 0 and (end < 0 or at + len(token) < end):
                end = at + len(token)
        return text[:end] if end > 0 else None

    def _keep_head(self, head: str, result: Tokenized) -> None:
        # Under the lock.
        assert self._heads is not None
        old = self._heads.pop(head, None)
        if old is not None:
            self._head_chars -= len(old.text)
        self._heads[head] = result
        self._head_chars += len(result.text)
        while self._head_chars > self._head_cap and self._heads:
            _, dropped = self._heads.popitem(last=False)
            self._head_chars -= len(dropped.text)

    def _encode_from(self, text: str, *candidates: Tokenized | None) -> Tokenized:
        """``text`` encoded without added special tokens, reusing the candidate that shares the
        most of it up to a special token."""
        best: tuple[int, str, int, Tokenized] | None = None
        for previous in candidates:
            if previous is not None:
                cut, token, after = self._safe_cut(previous, text)
                if cut and (best is None or cut > best[0]):
                    best = (cut, token, after, previous)
        if best is not None:
            # The special token ending at ``cut`` is followed, in the previous ids, by ``after``
            # more cut ids (a literal special token is always split out as one): everything up to
            # it is reused.
            cut, token, after, previous = best
            ids = previous.ids
            n = len(ids)
            cut_ids = self._cut_ids
            skip = after
            while n:
                if ids[n - 1] in cut_ids:
                    if not skip:
                        break
                    skip -= 1
                n -= 1
            if n and cut_ids[ids[n - 1]] == token:
                rest = self.tokenizer.encode(text[cut:], add_special_tokens=False)
                return Tokenized(text, ids[:n] + tuple(rest.ids), reused=n)
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return Tokenized(text, tuple(enc.ids))

    def _safe_cut(self, previous: Tokenized, text: str) -> tuple[int, str, int]:
        """The end of the last special token of the previous text that the new text shares all
        of the previous text before, that token, and how many special tokens follow it in the
        previous text; (0, "", 0) if none."""
        old = previous.text
        shared = common_prefix(old, text)
        cut, token = 0, ""
        for candidate in self._cut_tokens:
            at = old.rfind(candidate, 0, shared)
            if at >= 0 and at + len(candidate) > cut:
                cut, token = at + len(candidate), candidate
        if not cut:
            return 0, "", 0
        after = sum(old.count(t, cut) for t in self._cut_tokens) if cut < len(old) else 0
        return cut, token, after

    def chat_ids(self, messages: Sequence[Any], tools: Any = None, session: str | None = None) -> Tokenized:
        """``/v1/chat/completions``: the rendered template, without extra special tokens."""
        return self.encode(self.render_chat(messages, tools), add_special_tokens=False, session=session)

    def responses_ids(self, messages: Sequence[Any], tools: Any = None) -> Tokenized:
        """``/v1/responses``: the rendered template encoded *with* the tokenizer's special tokens,
        as vLLM 0.32 does (its ``ResponsesRequest.build_tok_params`` leaves ``add_special_tokens``
        at ``TokenizeParams``' default, True, where chat requests pass False): a tokenizer that adds
        a BOS puts a second one before the template's. Measured on the engines here: the Responses
        prompt is ``[BOS, BOS, ...]`` where the same chat is ``[BOS, ...]``, so the two APIs never
        share a block."""
        return self.encode(self.render_chat(messages, tools), add_special_tokens=True)

    def completion_ids(self, prompt: Any) -> Tokenized:
        """``/v1/completions``: a string encoded with special tokens, or token ids as given."""
        if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
            return Tokenized("", tuple(prompt))
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise TokenizerError("prompt is neither a string nor token ids")
        return self.encode(prompt, add_special_tokens=True)


class TokenizerRegistry:
    """Tokenizers per model, loaded at start (a missing directory is a config error)."""

    def __init__(self, directories: Mapping[str, str]) -> None:
        self.by_model = {model: PromptTokenizer(path) for model, path in directories.items()}

    def get(self, model: str) -> PromptTokenizer | None:
        """The tokenizer of ``model``, if one is configured."""
        return self.by_model.get(model)
