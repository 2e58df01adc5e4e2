"""The shared store on Redis: atomic claims with leases in Lua, Redis's own clock.

Per replica: a hash `slogate:inflight:{replica}` (request id → encoded entry) and a sorted
set `slogate:lease:{replica}` (request id → lease expiry). Every script first drops expired
leases, so a crashed gateway's claims vanish after `lease_s`; the count is the hash's size, so
it can never go negative. Times come from Redis (`TIME`), never from the gateways' clocks.
"""

from __future__ import annotations

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from slogate.gateway.state.base import Entry, SlotStore, StateUnavailable

_PURGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local dead = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
if #dead > 0 then
  redis.call('HDEL', KEYS[1], unpack(dead))
  redis.call('ZREM', KEYS[2], unpack(dead))
end
"""

# KEYS: inflight hash, lease zset. ARGV: id, budget, encoded entry without claim time, lease seconds.
CLAIM = _PURGE + """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 1 end
if redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3] .. '|' .. string.format('%.3f', now))
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[1])
return 1
"""

RELEASE = """
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""

# ARGV: id, phase, remaining (owner, input tokens and claim time are kept)
UPDATE = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return 0 end
local owner, _, inp, _, at = string.match(cur, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)$')
redis.call('HSET', KEYS[1], ARGV[1], owner .. '|' .. ARGV[2] .. '|' .. inp .. '|' .. ARGV[3] .. '|' .. at)
return 1
"""

# ARGV: lease seconds, ids...
RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
for i = 2, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then
    redis.call('ZADD', KEYS[2], now + tonumber(ARGV[1]), ARGV[i])
  end
end
return 1
"""

# KEYS: (inflight hash, lease zset) per replica; returns each replica's HGETALL after purging.
SNAPSHOT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local out = {}
for i = 1, #KEYS, 2 do
  local dead = redis.call('ZRANGEBYSCORE', KEYS[i + 1], '-inf', now)
  if #dead > 0 then
    redis.call('HDEL', KEYS[i], unpack(dead))
    redis.call('ZREM', KEYS[i + 1], unpack(dead))
  end
  out[#out + 1] = redis.call('HGETALL', KEYS[i])
end
return out
"""

# KEYS: gateways zset. ARGV: owner, ttl
HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
"""


# KEYS: the subject's key prefix. ARGV: window s, max requests (or -1), tokens, max tokens (or -1).
# The window comes from Redis's clock, so every gateway counts into the same one. (The counter
# keys are derived in the script: fine on one Redis, not for Redis Cluster.)
RATE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local w = tonumber(ARGV[1])
local win = math.floor(now / w)
local kn, kt = KEYS[1] .. ':' .. win .. ':n', KEYS[1] .. ':' .. win .. ':t'
local n = tonumber(redis.call('GET', kn) or '0')
local tok = tonumber(redis.call('GET', kt) or '0')
local left = (win + 1) * w - now
if (tonumber(ARGV[2]) >= 0 and n + 1 > tonumber(ARGV[2])) or (tonumber(ARGV[4]) >= 0 and tok + tonumber(ARGV[3]) > tonumber(ARGV[4])) then
  return {0, tostring(left)}
end
redis.call('INCR', kn)
redis.call('INCRBY', kt, ARGV[3])
redis.call('EXPIRE', kn, math.ceil(w) + 1)
redis.call('EXPIRE', kt, math.ceil(w) + 1)
return {1, '0'}
"""


PREFIX_HISTORY = 20_000  # dispatches the prefix stream keeps (~1 KB each at 64 blocks)


def encode_hashes(hashes: tuple[int, ...] | list[int]) -> str:
    """A prompt's block hashes for the stream: unsigned 64-bit little-endian, as hex."""
    return np.asarray(hashes, dtype="<u8").tobytes().hex()


def decode_hashes(h: str) -> list[int]:
    return np.frombuffer(bytes.fromhex(h), dtype="<u8").tolist()


class RedisStore(SlotStore):
    kind = "redis"

    def __init__(self, url: str, prefix: str = "slogate", timeout_s: float = 0.25) -> None:
        self.r = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True)
        self.prefix = prefix
        self._claim = self.r.register_script(CLAIM)
        self._release = self.r.register_script(RELEASE)
        self._update = self.r.register_script(UPDATE)
        self._renew = self.r.register_script(RENEW)
        self._snapshot = self.r.register_script(SNAPSHOT)
        self._heartbeat = self.r.register_script(HEARTBEAT)
        self._rate = self.r.register_script(RATE)

    def _keys(self, replica: str) -> list[str]:
        return [f"{self.prefix}:inflight:{replica}", f"{self.prefix}:lease:{replica}"]

    async def claim(self, replica: str, entry: Entry, budget: int, lease_s: float) -> bool:
        prefix = entry.encode().rsplit("|", 1)[0]
        try:
            return bool(await self._claim(keys=self._keys(replica), args=[entry.req_id, budget, prefix, lease_s]))
        except (RedisError, OSError) as e:
            raise StateUnavailable(str(e)) from e

    async def release(self, replica: str, req_id: str) -> None:
        try:
            await self._release(keys=self._keys(replica), args=[req_id])
        except (RedisError, OSError) as e:
            raise StateUnavailable(str(e)) from e

    async def update(self, replica: str, req_id: str, phase: str, remaining: float) -> None:
        try:
            await self._update(keys=self._keys(replica), args=[req_id, phase, f"{remaining:.1f}"])
        except (RedisError, OSError) as e:
            raise StateUnavailable(str(e)) from e

    async def renew(self, replica: str, req_ids: list[str], lease_s: float) -> None:
        if not req_ids:
            return
        try:
            await self._renew(keys=self._keys(replica), args=[lease_s, *req_ids])
        except (RedisError, OSError) as e:
            raise StateUnavailable(str(e)) from e

    async def snapshot(self, replicas: list[str]) -> dict[str, list[Entry]]:
        if not replicas:
            return {}
        try:
            raw = await self._snapshot(keys=[k for rep in replicas for k in self._keys(rep)])
        except (RedisError, OSError) as e:
            raise StateUnavailable(str(e)) from e
        out: dict[str, list[Entry]] = {}
        for rep, flat in zip(replicas, raw, strict=True):
            pairs = flat if isinstance(flat, list) else []
            out[rep] = [Entry.decode(pairs[i], pairs[i + 1]) for i in range(0, len(pairs), 2)]
        return out

    async def rate(self, subject: str, window_s: float, max_requests: int | None, tokens: int, max_tokens: int | None) -> tuple[bool, float]:
        try:
            ok, left = await self._rate(keys=[f"{self.prefix}:rate:{subject}"],
                                        args=[window_s, -1 if max_requests is None else max_requests, tokens, -1 if max_tokens is None else max_tokens])
        except (RedisError, OSError) as e:
            raise StateUnavailable(str(e)) from e
        return bool(int(ok)), float(left)

    async def heartbeat(self, owner: str, ttl_s: float) -> int:
        try:
            return int(await self._heartbeat(keys=[f"{self.prefix}:gateways"], args=[owner, ttl_s]))
        except (RedisError, OSError) as e:
            raise StateUnavailable(str(e)) from e

    async def leave(self, owner: str) -> None:
        try:
            await self.r.zrem(f"{self.prefix}:gateways", owner)
        except (RedisError, OSError) as e:
            raise StateUnavailable(str(e)) from e

    async def publish_prefixes(self, owner: str, items: list[tuple[str, tuple[int, ...]]]) -> None:
        if not items:
            return
        key = f"{self.prefix}:prefixes"
        try:
            async with self.r.pipeline(transaction=False) as p:
                for replica, hashes in items:
                    p.xadd(key, {"o": owner, "r": replica, "h": encode_hashes(hashes)},
                           maxlen=PREFIX_HISTORY, approximate=True)
                await p.execute()
        except (RedisError, OSError) as e:
            raise StateUnavailable(str(e)) from e

    async def read_prefixes(self, after: str, count: int) -> tuple[str, list[tuple[str, str, list[int]]]]:
        try:
            got = await self.r.xread({f"{self.prefix}:prefixes": after}, count=count)
        except (RedisError, OSError) as e:
            raise StateUnavailable(str(e)) from e
        out = []
        for _, entries in got or ():
            for eid, f in entries:
                after = eid
                try:
                    out.append((f["o"], f["r"], decode_hashes(f["h"])))
                except (KeyError, ValueError):
                    continue  # not ours to read (another version's entry): skip it
        return after, out

    async def close(self) -> None:
        await self.r.aclose()
