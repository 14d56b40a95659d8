"""The lab's tests share the router tests' fixtures (a real redis-server, a locally trained tokenizer)."""

from tests.conftest import redis_server, tokenizer_dir

__all__ = ["redis_server", "tokenizer_dir"]
