"""Precise prefix caches: each replica's picture from the engine's own KV-cache events.

vLLM (`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"tcp://*:5557"}'`) publishes on a ZMQ PUB socket, per engine step, a msgpack batch
`[ts, events, dp_rank]` in frames `(topic, seq, payload)`: `BlockStored` (the engine hashes of
new or reused full blocks, their parent's hash, their token ids), `BlockRemoved` (hashes
evicted) and `AllBlocksCleared` (`/reset_prefix_cache`). The engine's hashes are its own
(SHA-256 of the parent hash, the ids and extra keys, with a seed); the gateway does not compute
them: it re-hashes each stored block's token ids into its own chain, continuing from the
parent's state, so a block the engine holds becomes the same hashes `token_block_hashes` gives
the prompt that would hit it. Removals and clears then take exactly those out.

SGLang (`--kv-events-config`, the same ZMQ publisher and replay) sends the same three events,
array-like (`["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium]`, as vLLM did
before 0.11), one page per `BlockStored`: its `--page-size` must be a multiple of
`prefix.block_tokens` (the default page of 1 token is refused as "misaligned", logged once).

Between dispatch and the engine's event (its prefill, a fraction of a second) the dispatch
itself has put the prompt in the picture, as without events; what events add is the engine's
evictions, clears, restarts and the requests other clients sent it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from slogate.router.prefix import ROOT, PrefixCache, token_block_hashes

if TYPE_CHECKING:
    from slogate.gateway.fleet import Backend
    from slogate.gateway.metrics import Metrics

log = logging.getLogger("slogate.gateway")
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's replay: nothing more
# Array-like events (SGLang; vLLM before 0.11): the tag, then the fields in this order (trailing
# defaults may be left out).
FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
          "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}


def as_event(ev: Any) -> dict[str, Any] | None:
    """An event as a map (vLLM ≥ 0.11's form), from either form; None: not one of the three."""
    if isinstance(ev, dict):
        return ev
    if isinstance(ev, (list, tuple)) and ev and isinstance(ev[0], str) and ev[0] in FIELDS:
        return {"type": ev[0], **dict(zip(FIELDS[ev[0]], ev[1:], strict=False))}
    return None


class EngineBlocks:
    """One engine's cached blocks, from its events, kept in `cache` as the gateway's hashes."""

    def __init__(self, cache: PrefixCache, block_tokens: int) -> None:
        self.cache = cache
        self.block_tokens = block_tokens
        # engine block hash -> (the gateway chain's state after it, its gateway block hashes);
        # bounded in case removals are lost (a dropped batch): the oldest go first.
        self.chains: OrderedDict[Any, tuple[tuple[int, int], tuple[int, ...]]] = OrderedDict()
        self.bound = 4 * cache.capacity + 1024
        self.misaligned: int | None = None  # the block size of the last event refused as not whole gateway blocks

    def stored(self, hashes: list[Any], parent: Any, token_ids: list[int], block_size: int) -> str | None:
        """Apply one `BlockStored`; the reason it could not be, else None."""
        if block_size % self.block_tokens:
            self.misaligned = block_size
            return "misaligned"  # engine blocks must be whole gateway blocks
        if parent is None:
            state = ROOT
        else:
            got = self.chains.get(parent)
            if got is None:
                return "unknown_parent"  # stored before we listened, or its event was lost
            state = got[0]
        chains, added = self.chains, []
        for i, h in enumerate(hashes):
            ids = token_ids[i * block_size:(i + 1) * block_size]
            if len(ids) < block_size:
                break
            sub, state = token_block_hashes(ids, self.block_tokens, state)
            chains[h] = (state, sub)
            chains.move_to_end(h)
            added.extend(sub)
        while len(chains) > self.bound:
            chains.popitem(last=False)
        self.cache.insert(added)
        return None

    def removed(self, hashes: list[Any]) -> None:
        for h in hashes:
            got = self.chains.pop(h, None)
            if got is not None:
                self.cache.remove(got[1])

    def cleared(self) -> None:
        self.chains.clear()
        self.cache.clear()

    def apply(self, events: list[Any]) -> dict[str, int]:
        """One batch's events (decoded msgpack); counts by kind."""
        n: dict[str, int] = {}
        for raw in events:
            ev = as_event(raw)
            if ev is None:
                continue
            kind = ev.get("type")
            if kind == "BlockStored":
                if ev.get("group_idx") not in (None, 0):
                    continue  # another KV-cache group (a hybrid model's sliding window): not the prefix cache
                why = self.stored(ev["block_hashes"], ev.get("parent_block_hash"), ev["token_ids"], int(ev["block_size"]))
                k = why or "stored"
                n[k] = n.get(k, 0) + len(ev["block_hashes"])
            elif kind == "BlockRemoved":
                if ev.get("group_idx") not in (None, 0):
                    continue
                self.removed(ev["block_hashes"])
                n["removed"] = n.get("removed", 0) + len(ev["block_hashes"])
            elif kind == "AllBlocksCleared":
                self.cleared()
                n["cleared"] = n.get("cleared", 0) + 1
        return n


def endpoint_for(template: str, url: str) -> str:
    """`backends[].kv_events` for this replica: `{host}` is its host (discovered replicas)."""
    return template.replace("{host}", urlsplit(url).hostname or "127.0.0.1")


class KVEventFeeds:
    """A subscriber task per replica whose engine publishes KV-cache events."""

    def __init__(self, block_tokens: int, topic: str, metrics: Metrics) -> None:
        self.block_tokens, self.topic, self.metrics = block_tokens, topic, metrics
        self.tasks: dict[int, tuple[str, asyncio.Task[None]]] = {}  # by replica id: (endpoint, its subscriber)

    def sync(self, backends: list[Backend]) -> None:
        """Listen to every replica that has an endpoint and a picture; stop for those gone, and
        move to a replica's new endpoint after a reload."""
        live = {b.view.rid: (endpoint_for(ep, b.cfg.url), b) for b in backends if (ep := b.kv_events) and b.view.cache is not None}
        for rid in [r for r, (ep, _) in self.tasks.items() if r not in live or live[r][0] != ep]:
            self.tasks.pop(rid)[1].cancel()
        loop = asyncio.get_running_loop()
        for rid, (ep, b) in live.items():
            if rid not in self.tasks or self.tasks[rid][1].done():  # new, or failed (logged): again
                self.tasks[rid] = (ep, loop.create_task(self._listen(b, ep)))

    async def close(self) -> None:
        for _, t in self.tasks.values():
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self.tasks.clear()

    async def _listen(self, b: Backend, endpoint: str) -> None:
        import msgspec
        import zmq
        import zmq.asyncio

        assert b.view.cache is not None
        blocks = EngineBlocks(b.view.cache, self.block_tokens)
        count = self.metrics.kv_events
        sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)  # ZMQ connects (and reconnects) in the background
        except zmq.ZMQError as e:
            sock.close(linger=0)
            log.error("replica %s: cannot read KV-cache events from %s: %s", b.name, endpoint, e)
            count.labels(b.name, "connect_failed").inc()
            return
        log.info("replica %s: reading its KV-cache events from %s", b.name, endpoint)
        try:
            # Subscribed first, then the replay: a batch published in between comes both ways.
            replayed = await self._replay(b, endpoint_for(b.kv_replay, b.cfg.url), blocks) if b.kv_replay else -1
            last: int | None = replayed if replayed >= 0 else None
            warned = False
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    count.labels(b.name, "undecodable").inc()
                    continue
                seq = int.from_bytes(frames[1], "big")
                if replayed >= 0:
                    if seq <= replayed:
                        continue  # the replay brought it already
                    replayed = -1
                if last is not None and seq != last + 1:
                    if seq <= last:  # the engine restarted: its cache is empty
                        blocks.cleared()
                        count.labels(b.name, "restarted").inc()
                    else:  # a batch dropped (the publisher's high-water mark): blocks it held stay unknown
                        count.labels(b.name, "missed_batches").inc(seq - last - 1)
                last = seq
                try:
                    batch = msgspec.msgpack.decode(frames[2])
                    got = blocks.apply(batch[1])
                except (msgspec.DecodeError, KeyError, IndexError, TypeError, ValueError):
                    count.labels(b.name, "undecodable").inc()
                    continue
                self._count(b, got)
                if blocks.misaligned is not None and not warned:
                    warned = True
                    log.warning("replica %s: its KV-cache events come in blocks of %d tokens, not a multiple of prefix.block_tokens "
                                "(%d): they are not applied (SGLang: start it with --page-size %d or a multiple)",
                                b.name, blocks.misaligned, self.block_tokens, self.block_tokens)
        finally:
            sock.close(linger=0)

    def _count(self, b: Backend, got: dict[str, int]) -> None:
        for kind, k in got.items():
            self.metrics.kv_events.labels(b.name, kind).inc(k)

    async def _replay(self, b: Backend, endpoint: str, blocks: EngineBlocks, timeout_s: float = 5.0) -> int:
        """The batches vLLM still buffers (its last `buffer_steps`), applied in order: what the
        engine stored before this gateway listened. The last sequence number applied (-1: none)."""
        import msgspec
        import zmq
        import zmq.asyncio

        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        last, n = -1, 0
        try:
            sock.connect(endpoint)
            await sock.send_multipart((b"", (0).to_bytes(8, "big")))
            async with asyncio.timeout(timeout_s):
                while True:
                    frames = await sock.recv_multipart()  # (b"", topic, seq, payload); the end: seq -1
                    if len(frames) != 4 or frames[2] == END_SEQ:
                        break
                    got = blocks.apply(msgspec.msgpack.decode(frames[3])[1])
                    last, n = int.from_bytes(frames[2], "big"), n + 1
                    self._count(b, got)
        except (TimeoutError, zmq.ZMQError, msgspec.DecodeError, KeyError, IndexError, TypeError, ValueError) as e:
            log.warning("replica %s: replaying its KV-cache events from %s stopped: %s", b.name, endpoint, e or type(e).__name__)
        finally:
            sock.close(linger=0)
        self.metrics.kv_events.labels(b.name, "replayed_batches").inc(n)
        return last
