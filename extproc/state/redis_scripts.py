"""The two server-side scripts of the Redis store: one lookup and one record, each a single call.

Why scripts rather than a pipeline of plain commands: the prefix search is a binary search per
replica (hashes are chained, so a replica holding block ``i`` holds blocks ``0..i``) and each
probe depends on the previous answer. A pipeline cannot branch, so it would have to fetch every
block of the prompt (up to 512 keys) and send them all back; the script probes about
``replicas x log2(blocks)`` members inside Redis and returns a handful of ``replica, count``
pairs. Block hashes travel as one packed binary argument (8 bytes each) rather than one argument
per block: redis-py spends about a microsecond packing each argument, 100 us for a long prompt.

Time: expiry of prefix entries is measured with Redis's own clock (``TIME``), the only clock all
gateways share; each gateway's monotonic clock still drives its local state.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# KEYS[1] the session's pin (any key of the model's slot when there is no session)
# KEYS[2] the model's replica registry
# ARGV[1] session TTL in ms, "0" when there is no session to read
# ARGV[2] prefix TTL in ms
# ARGV[3] the prefix-index key of a replica, less the replica's name
# ARGV[4] the request's block hashes, 8 bytes each
# Returns {pinned or false, replica, matched blocks, replica, matched blocks, ...}.
LOOKUP = """
local pinned = false
if ARGV[1] ~= '0' then
  pinned = redis.call('GETEX', KEYS[1], 'PX', ARGV[1])
end
local out = {pinned}
local blob = ARGV[4]
local n = #blob / 8
if n < 1 then return out end
local t = redis.call('TIME')
local cutoff = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - tonumber(ARGV[2])
local replicas = redis.call('ZRANGEBYSCORE', KEYS[2], string.format('%.17g', cutoff), '+inf')
for _, replica in ipairs(replicas) do
  local key = ARGV[3] .. replica
  local first = redis.call('ZSCORE', key, string.sub(blob, 1, 8))
  if first and tonumber(first) >= cutoff then
    local lo, hi = 0, n - 1
    while lo < hi do
      local mid = math.floor((lo + hi + 1) / 2)
      local s = redis.call('ZSCORE', key, string.sub(blob, mid * 8 + 1, mid * 8 + 8))
      if s and tonumber(s) >= cutoff then lo = mid else hi = mid - 1 end
    end
    out[#out + 1] = replica
    out[#out + 1] = lo + 1
  end
end
return out
"""

# KEYS[1] the session's pin, KEYS[2] the model's replica registry, KEYS[3] the replica's index
# ARGV[1] session TTL in ms, "0" when there is no session
# ARGV[2] prefix TTL in ms
# ARGV[3] the replica
# ARGV[4] how many blocks a replica's index keeps (its cache, approximately)
# ARGV[5] the request's block hashes, 8 bytes each
# ARGV[6] "1" to pin the session, "0" only to slide its TTL (the session was used)
# ARGV[7] how old (ms) the prompt's first block may be before the held blocks are written again
RECORD = """
if ARGV[1] ~= '0' then
  if ARGV[6] == '1' then
    redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[1])
  else
    redis.call('PEXPIRE', KEYS[1], ARGV[1])
  end
end
local blob = ARGV[5]
local n = #blob / 8
if n < 1 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local key = KEYS[3]
local function score(i)
  local s = redis.call('ZSCORE', key, string.sub(blob, i * 8 + 1, i * 8 + 8))
  return s and tonumber(s)
end
-- A conversation's next turn resends the whole previous turn: the blocks this replica already
-- holds, written recently as a whole (the first block is written with the rest, newest), stay
-- as they are and only the new tail is written. Writing every block each time cost Redis four
-- times as much; the held blocks are written again once the first is ARGV[7] ms old.
local start = 0
local first = score(0)
if first and first >= now - tonumber(ARGV[7]) then
  local lo, hi = 0, n - 1
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    local s = score(mid)
    if s and s >= now - ttl then lo = mid else hi = mid - 1 end
  end
  start = lo + 1
end
if start < n then
  -- Each write takes the millisecond after the replica's newest entry if that is not in the
  -- past, so a later request is always more recent in LRU order (it runs ahead of the clock only
  -- above a thousand writes a second to one replica). Within it, a prompt's first blocks get the
  -- newest scores, so trimming to the bound drops a prompt's tail before its head.
  local base = now
  local top = redis.call('ZREVRANGE', key, 0, 0, 'WITHSCORES')
  if top[2] and math.floor(tonumber(top[2])) >= base then base = math.floor(tonumber(top[2])) + 1 end
  local args = {}
  for i = start, n - 1 do
    args[#args + 1] = string.format('%.17g', base + (n - i) / (n + 1))
    args[#args + 1] = string.sub(blob, i * 8 + 1, i * 8 + 8)
    if #args >= 1000 then
      redis.call('ZADD', key, unpack(args))
      args = {}
    end
  end
  if #args > 0 then redis.call('ZADD', key, unpack(args)) end
end
local expired = '(' .. string.format('%.17g', now - ttl)
redis.call('ZREMRANGEBYSCORE', key, '-inf', expired)
local excess = redis.call('ZCARD', key) - tonumber(ARGV[4])
if excess > 0 then redis.call('ZREMRANGEBYRANK', key, 0, excess - 1) end
redis.call('PEXPIRE', key, ttl)
redis.call('ZADD', KEYS[2], now, ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', expired)
redis.call('PEXPIRE', KEYS[2], ttl)
return n - start
"""


def sha1(script: str) -> str:
    """The SHA-1 Redis names a script by (EVALSHA)."""
    return hashlib.sha1(script.encode()).hexdigest()


LOOKUP_SHA = sha1(LOOKUP)
RECORD_SHA = sha1(RECORD)


def pack_hashes(hashes: Sequence[int]) -> bytes:
    """Block hashes as one binary argument, 8 big-endian bytes each (unsigned 64-bit)."""
    return struct.pack(f">{len(hashes)}Q", *hashes)


def parse_lookup(reply: Sequence[object]) -> tuple[str | None, dict[str, int]]:
    """The pinned replica and the prefix matches from the lookup script's reply."""
    first = reply[0] if reply else None
    pinned = first.decode() if isinstance(first, bytes) else None
    matches: dict[str, int] = {}
    for i in range(1, len(reply) - 1, 2):
        name, count = reply[i], reply[i + 1]
        if isinstance(name, bytes) and isinstance(count, int):
            matches[name.decode()] = count
    return pinned, matches
