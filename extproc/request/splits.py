"""Traffic splits: canary and A/B rules that send a share of a model's requests to another model
name (a new version, a LoRA adapter) and, optionally, another pool of replicas.

Rules are tried in order, first match wins. The arm is chosen by hashing the request's session
key (else its ``user``, else its request id) with the rule's name, so every turn of a
conversation lands in the same arm; a request may pin an arm by naming its target model in the
rule's pin header (``x-canary: support-v2``). Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qsl

import xxhash

HASH_SPACE = 1 << 32


@dataclass(frozen=True, slots=True)
class SplitTarget:
    """One arm of a rule: the model name written into the body, its weight, its pool label."""

    model: str
    weight: float
    pool: str | None = None


@dataclass(frozen=True, slots=True)
class SplitRule:
    """Which requests a rule takes (every condition given must hold) and its arms."""

    name: str
    targets: tuple[SplitTarget, ...]
    model: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    cookies: Mapping[str, str] = field(default_factory=dict)
    query: Mapping[str, str] = field(default_factory=dict)
    pin_header: str = "x-canary"

    def matches(self, model: str, headers: Mapping[str, str]) -> bool:
        """Whether a request for ``model`` with ``headers`` (Envoy's, ``:path`` included) is taken."""
        if self.model is not None and not fnmatch.fnmatchcase(model, self.model):
            return False
        if any(headers.get(k) != v for k, v in self.headers.items()):
            return False
        if self.cookies:
            jar = _cookies(headers.get("cookie", ""))
            if any(jar.get(k) != v for k, v in self.cookies.items()):
                return False
        if self.query:
            params = dict(parse_qsl(headers.get(":path", "").partition("?")[2], keep_blank_values=True))
            if any(params.get(k) != v for k, v in self.query.items()):
                return False
        return True

    def arm_for(self, key: str) -> int:
        """The index of the arm a hash key falls in, in proportion to the weights."""
        total = sum(t.weight for t in self.targets)
        point = xxhash.xxh3_64_intdigest(f"{self.name}\x1f{key}".encode()) % HASH_SPACE / HASH_SPACE * total
        upto = 0.0
        for i, target in enumerate(self.targets):
            upto += target.weight
            if point < upto:
                return i
        return len(self.targets) - 1


@dataclass(frozen=True, slots=True)
class Arm:
    """The arm a request landed in: the rule, the target, and how it was chosen."""

    rule: str
    target: SplitTarget
    pinned: bool = False

    @property
    def label(self) -> str:
        """The arm as a metric label: its target model."""
        return self.target.model


def _cookies(header: str) -> dict[str, str]:
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(header)
    except CookieError:
        return {}
    return {k: m.value for k, m in jar.items()}


def choose_arm(rules: tuple[SplitRule, ...], model: str, headers: Mapping[str, str], key: str | None) -> Arm | None:
    """The arm of the first rule matching the request, or None. ``key`` is what the arm is hashed
    on (session, user or request id); a request with none goes to the first arm."""
    for rule in rules:
        if not rule.matches(model, headers):
            continue
        wanted = headers.get(rule.pin_header)
        if wanted:
            for target in rule.targets:
                if target.model == wanted:
                    return Arm(rule.name, target, pinned=True)
        index = rule.arm_for(key) if key else 0
        return Arm(rule.name, rule.targets[index])
    return None


def encode_body(body: Mapping[str, object]) -> bytes:
    """A parsed request body as JSON again, to send in the client's body's place."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def rewrite_model(body: Mapping[str, object], model: str) -> bytes:
    """The JSON of ``body`` (a parsed request body) with its ``model`` replaced."""
    return encode_body({**body, "model": model})
