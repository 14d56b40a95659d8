"""A backend that answers like vLLM but whose /metrics page never moves: vLLM's own sample page,
served as it is (its prefix-cache counters stay where they are), as a replica with prefix caching
off, a cached or frozen page, or an exporter that stopped would show it.

A file named ``<name>.overloaded`` in ``--flags`` makes the page report a long queue and a full KV
cache (as an overloaded replica would), for as long as the file exists.

    python tests/backends/frozen_vllm.py --name replica-0 --port 8001 --flags DIR
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from aiohttp import web

SAMPLE = Path(__file__).resolve().parent.parent / "data" / "vllm_metrics_sample.txt"


def overloaded(page: str) -> str:
    """The page with 50 waiting requests and a KV cache 99% used."""
    page = re.sub(r"^(vllm:num_requests_waiting\{[^}]*\}) \S+$", r"\1 50.0", page, flags=re.M)
    return re.sub(r"^(vllm:kv_cache_usage_perc\{[^}]*\}) \S+$", r"\1 0.99", page, flags=re.M)


def app(name: str, flags: Path) -> web.Application:
    page = SAMPLE.read_text()
    busy = overloaded(page)

    async def metrics(request: web.Request) -> web.Response:
        text = busy if (flags / f"{name}.overloaded").exists() else page
        return web.Response(text=text, content_type="text/plain")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def completion(request: web.Request) -> web.Response:
        body = await request.read()
        model = json.loads(body or b"{}").get("model", "m") if body else "m"
        reply = {
            "id": f"cmpl-{time.monotonic_ns()}",
            "object": "chat.completion",
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(body) // 4, "completion_tokens": 1, "total_tokens": len(body) // 4 + 1},
        }
        return web.json_response(reply, headers={"x-replica-name": name})

    application = web.Application(client_max_size=64 * 1024 * 1024)
    application.router.add_get("/metrics", metrics)
    application.router.add_get("/health", health)
    application.router.add_post("/v1/chat/completions", completion)
    application.router.add_post("/v1/completions", completion)
    return application


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--flags", type=Path, required=True)
    args = parser.parse_args()
    web.run_app(app(args.name, args.flags), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
