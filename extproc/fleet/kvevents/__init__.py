"""vLLM's KV-cache events: what each engine really holds, as a prefix index the router can query.

- :mod:`.hashing`: vLLM's block-hash chain (``sha256``, ``sha256_cbor``) and a content-hash chain
  for fleets whose hash is not reproducible;
- :mod:`.wire`: decoding event batches (tagged arrays, and tagged maps as in vLLM 0.33);
- :mod:`.index`: the prefix index per model and replica, with tiers and speculative credit;
- :mod:`.subscriber`: the ZMQ subscribers (sequence tracking, replay, restart detection);
- :mod:`.source`: what the router asks of it.
"""
