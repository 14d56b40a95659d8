"""The config's sections no subsystem owns: headers, sessions, request, prefix, ring, metrics,
gRPC, admin, spillover and disaggregation (each subsystem's own section lives beside it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from extproc.base.validation import Section, field_error, option
from extproc.config.held import held_as
from extproc.request.features import FeatureSettings
from extproc.request.session import SessionSource
from extproc.routing.disagg import PairSettings


class Headers(Section):
    """``headers:``: the names of the routing headers the processor sets (and strips from clients)."""

    target_cluster: str = option("x-target-cluster", "cluster mode: the header a route's cluster_header reads")
    destination_endpoint: str = option(
        "x-gateway-destination-endpoint", "endpoint mode: the GIE endpoint-picker header (ip:port)"
    )

    @field_validator("target_cluster", "destination_endpoint")
    @classmethod
    def _lower(cls, value: str) -> str:
        return value.lower()


class Sessions(Section):
    """``sessions:``."""

    ttl_s: float = option(600.0, "a session's pin expires this long after its last turn (sliding)", gt=0)
    max_sessions: int = option(100_000, "pins kept at most (LRU)", ge=1)


SessionSourceItem = Annotated[
    SessionSource, held_as(str, SessionSource, SessionSource.parse, lambda s: f"{s.kind}:{s.name}")
]


class Request(Section):
    """``request:``: how a request's session is found, and how much of it is parsed."""

    session_sources: tuple[SessionSourceItem, ...] = option(
        FeatureSettings().session_sources,
        "where the session key is read, first found wins (header:, cookie:, body: dotted path)",
        strict=False,
    )
    max_body_bytes: int = option(
        FeatureSettings().max_body_bytes, "larger bodies are routed on the session key without parsing", ge=1
    )
    conversations: bool = option(
        FeatureSettings().conversations,
        "a chat request without a session key is known by its messages (its conversation's session)",
    )


class Prefix(Section):
    """``prefix:``: prefix block hashing and the prefix index."""

    block_chars: int = option(
        FeatureSettings().block_chars, "characters per block: 16 tokens x ~4 characters, as GIE", ge=1
    )
    max_blocks: int = option(FeatureSettings().max_blocks, "blocks hashed at most (the first 128 KB of a prompt)", ge=1)
    blocks_per_replica: int = option(31_250, "prefix index entries kept per replica", ge=1)


class Ring(Section):
    """``ring:``: the consistent-hash ring that places new sessions on an idle fleet."""

    vnodes: int = option(128, "virtual nodes per replica (times its weight)", ge=1)
    key_blocks: int = option(32, "a request without a session is hashed on its first blocks (2 KB)", ge=1)


class Metrics(Section):
    """``metrics:``: Prometheus exposition."""

    enabled: bool = option(True, "serve /metrics")
    listen: str = option("127.0.0.1:9190", "HOST:PORT of /metrics (its own port, never the ext_proc one)")

    @property
    def address(self) -> str | None:
        """Where /metrics is served, None when it is not."""
        return self.listen if self.enabled else None


class ListenerTls(Section):
    """TLS on a listener (``grpc.tls``, ``admin.tls``, or ``--tls-cert``/``--tls-key``).

    Files only, never inline PEM, so the key stays out of config files and process listings;
    re-read when they change. With ``client_ca_file`` it is mutual TLS: a client must present a
    certificate that CA signed.
    """

    cert_file: str = Field(description="PEM certificate chain")
    key_file: str = Field(description="PEM private key")
    client_ca_file: str | None = option(None, "mutual TLS: refuse clients without a certificate this CA signed")

    @property
    def mutual(self) -> bool:
        """Whether client certificates are required."""
        return self.client_ca_file is not None


class Grpc(Section):
    """``grpc:``: the ext_proc listener."""

    max_message_bytes: int = option(32 * 1024 * 1024, "a buffered body arrives as one message", ge=1024)
    # kubelet's gRPC probes speak plaintext, so with tls they need a listener of their own.
    health_listen: str | None = option(None, "also serve gRPC health alone, in plaintext, here (kubelet probes)")
    tls: ListenerTls | None = option(None, "TLS on the listener (off by default: loopback)")
    secure_serving: bool | None = option(
        None,
        "without tls: serve TLS with a self-signed certificate made at start (as GIE's picker); "
        "null: on when following an InferencePool (discovery type inference_pool), else off",
    )
    grace_s: float = option(5.0, "on SIGTERM, streams in flight get this long to finish", ge=0)
    server: Literal["grpcio", "grpclib"] = option(
        "grpcio",
        "the ext_proc port's gRPC server: grpcio (with reflection and the admin API), or grpclib "
        "(ext_proc and health on the event loop's own thread: more requests a second and less CPU "
        "a request at usual prompt sizes, fewer at 200 KB; docs/performance.md)",
    )


class AdminSettings(Section):
    """``admin:``: the admin gRPC API (Explain, replicas, sessions, cordon, drain, watch).

    On the ext_proc port by default (``listen`` null), on a port of its own with ``listen``, not
    at all without ``enabled`` (``listen: 'off'`` is read as ``enabled: false``).
    """

    enabled: bool = option(True, "serve the admin API (`extproc admin` talks to it)")
    listen: str | None = option(
        None, "null: on the ext_proc port (`listen`); HOST:PORT: a port of its own; 'off': not served"
    )
    token_file: str | None = option(
        None,
        "file holding the bearer token that mutating calls need (without it, or mTLS, they are refused); "
        "on an ext_proc port off loopback, every call needs it",
    )
    tls: ListenerTls | None = option(
        None, "TLS on admin.listen's own port; with client_ca_file, a client certificate also authorises mutations"
    )
    watch_sample_rate: float = option(
        0.1, "share of decisions WatchDecisions sends when the watcher asks for none", gt=0, le=1
    )

    @model_validator(mode="before")
    @classmethod
    def _off(cls, raw: Any) -> Any:
        if isinstance(raw, Mapping) and raw.get("listen") == "off":
            return {**raw, "enabled": False, "listen": None}
        return raw

    @model_validator(mode="after")
    def _tls_needs_its_own_port(self) -> AdminSettings:
        if self.tls is not None and self.enabled and self.listen is None:
            # On the ext_proc port the admin API is served with grpc.tls; admin.tls alone would be ignored.
            raise field_error(
                AdminSettings,
                "tls",
                "TLS of a separate admin listener, so set admin.listen too (see docs/ports.md)",
                None,
            )
        return self


class Spillover(Section):
    """``spillover:``: requests of an overloaded replica's sessions go elsewhere."""

    repin: bool = option(False, "move the session's pin to where it spilled (else it returns when the load drops)")


class Disaggregation(Section):
    """``disaggregation:``: how a prefill/decode pair is weighed where replicas carry roles
    (``llm-d.ai/role``; docs/disaggregation.md). A fleet without roles never reads it."""

    threshold_tokens: int = option(
        PairSettings().threshold_tokens, "prompt tokens the decode replica lacks below which it prefills itself", ge=0
    )
    decode_interference: float = option(
        PairSettings().decode_interference,
        "the stall of each sequence decoding, per prompt token a decode replica prefills itself",
        ge=0,
    )

    weigh_local: bool = option(
        True,
        "hop only if the prefill replica finishes the prompt sooner than the decode replica would; "
        "false: whenever the decode replica lacks threshold_tokens (llm-d's threshold decider)",
    )

    def pair_settings(self, block_tokens: int) -> PairSettings:
        """The pair's settings, with the KV block size in tokens."""
        return PairSettings(
            threshold_tokens=self.threshold_tokens,
            decode_interference=self.decode_interference,
            weigh_local=self.weigh_local,
            block_tokens=max(1, block_tokens),
        )
