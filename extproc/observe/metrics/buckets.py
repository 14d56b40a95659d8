"""Histogram buckets of the router's instruments, each fitted to what it times."""

from __future__ import annotations

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# The router's own time to first token and end-to-end time per replica: finer than TTFT_BUCKETS
# where prefills sit (10 ms to 2 s), so a quantile read from them is within ~20% of the samples'.
FIRST_TOKEN_BUCKETS = (
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    10.0,
    30.0,
)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
OUTPUT_TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 16384)
"""An answer's output tokens: powers of two where chat answers end, up to long generations."""
