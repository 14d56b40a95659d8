"""Tokenizing prompts as vLLM does, so the router can compute the engine's own block hashes.

A model's tokenizer is a directory holding ``tokenizer.json`` and ``tokenizer_config.json`` (its
``chat_template`` and special tokens), read with the ``tokenizers`` library. For
``/v1/chat/completions`` the chat template is rendered as vLLM renders it (through Hugging Face's
``apply_chat_template``: a sandboxed jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``,
``add_generation_prompt``) and the text is encoded without adding special tokens; for
``/v1/completions`` the prompt is encoded with them.

Incremental where it is safe: a session's next turn usually re-sends the last turn's text and
adds to it. Tokens never straddle a special token (added tokens are split out before the model
runs), so everything up to the last special token of the text already tokenized is reused and
only the rest is encoded again.
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


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be used, or a request it cannot render."""


@dataclass(frozen=True, slots=True)
class Tokenized:
    """A prompt's rendered text and token ids."""

    text: str
    ids: tuple[int, ...]
    reused: int = 0
    """How many leading tokens came from the session's previous turn."""


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

    def __init__(self, directory: str | Path, session_cache: int = 4096) -> None:
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
        self._lock = threading.Lock()

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
        """Token ids of ``text``; with ``session``, reusing what its previous turn tokenized."""
        previous = None
        if session is not None:
            with self._lock:
                previous = self._sessions.get(session)
        result = self._encode_from(text, add_special_tokens, previous)
        if session is not None:
            with self._lock:
                self._sessions[session] = result
                self._sessions.move_to_end(session)
                while len(self._sessions) > self._session_cap:
                    self._sessions.popitem(last=False)
        return result

    def _encode_from(self, text: str, add_special_tokens: bool, previous: Tokenized | None) -> Tokenized:
        cut, token = self._safe_cut(previous, text) if previous is not None and not add_special_tokens else (0, "")
        if cut and previous is not None:
            # The special token ending at ``cut`` is the last special id of the previous ids (a
            # literal special token is always split out as one): everything up to it is reused.
            ids = previous.ids
            n = len(ids)
            cut_ids = self._cut_ids
            while n and ids[n - 1] not in cut_ids:
                n -= 1
            if n and cut_ids[ids[n - 1]] == token:
                rest = self.tokenizer.encode(text[cut:], add_special_tokens=False)
                return Tokenized(text, ids[:n] + tuple(rest.ids), reused=n)
        enc = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return Tokenized(text, tuple(enc.ids))

    def _safe_cut(self, previous: Tokenized, text: str) -> tuple[int, str]:
        """The end of the last special token of the previous text and that token, if the new
        text shares all of the previous text before it; (0, "") otherwise."""
        old = previous.text
        cut, token = 0, ""
        for candidate in self._cut_tokens:
            at = old.rfind(candidate)
            if at >= 0 and at + len(candidate) > cut:
                cut, token = at + len(candidate), candidate
        if cut and text.startswith(old[:cut]):
            return cut, token
        return 0, ""

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
