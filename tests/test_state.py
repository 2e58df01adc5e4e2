"""One contract suite for both slot stores: memory and a real redis-server."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from slogate.gateway.state.base import Entry
from slogate.gateway.state.memory import MemoryStore
from slogate.gateway.state.redis import RedisStore

_ns = itertools.count()


@pytest.fixture(params=["memory", "redis"])
def store(request, redis_url):
    """The store, made inside each test's event loop (a redis client belongs to one loop). A
    generous timeout: these tests are about the contract, and 50 connections opened at once on a
    loaded 2-core CI box took longer than the gateway's 0.25 s default to connect."""
    prefix = f"t{next(_ns)}"
    return MemoryStore if request.param == "memory" else (lambda: RedisStore(redis_url, prefix=prefix, timeout_s=5.0))


def e(i: int, owner: str = "gw1") -> Entry:
    return Entry(f"r{i}", owner, "prefill", 100 + i, 50.0, 0.0)


def run(make, test):
    async def go():
        s = make()
        try:
            await test(s)
        finally:
            await s.close()

    asyncio.run(go())


def test_claims_stop_at_the_budget_and_release_frees(store) -> None:
    async def go(store):
        got = [await store.claim("A", e(i), 3, 30) for i in range(5)]
        assert got == [True, True, True, False, False]
        assert await store.claim("A", e(0), 3, 30)  # re-claiming one's own entry is idempotent
        await store.release("A", "r1")
        await store.release("A", "r1")  # twice: no negative counts
        assert await store.claim("A", e(9), 3, 30)
        assert not await store.claim("A", e(10), 3, 30)
        snap = await store.snapshot(["A", "B"])
        assert sorted(x.req_id for x in snap["A"]) == ["r0", "r2", "r9"] and snap["B"] == []
        x = next(x for x in snap["A"] if x.req_id == "r2")
        assert (x.owner, x.phase, x.input_tokens, x.remaining) == ("gw1", "prefill", 102, 50.0) and x.claimed_at > 0

    run(store, go)


def test_update_changes_phase_and_remaining(store) -> None:
    async def go(store):
        await store.claim("A", e(1), 4, 30)
        await store.update("A", "r1", "decode", 12.0)
        await store.update("A", "gone", "decode", 1.0)  # no-op
        (x,) = (await store.snapshot(["A"]))["A"]
        assert x.phase == "decode" and x.remaining == 12.0

    run(store, go)


def test_leases_expire_and_renewal_keeps_them(store) -> None:
    async def go(store):
        await store.claim("A", e(1), 2, 0.3)
        await store.claim("A", e(2), 2, 0.3)
        assert not await store.claim("A", e(3), 2, 0.3)
        for _ in range(3):
            await asyncio.sleep(0.15)
            await store.renew("A", ["r1"], 0.3)  # r1's gateway is alive, r2's crashed
        snap = await store.snapshot(["A"])
        assert [x.req_id for x in snap["A"]] == ["r1"]
        assert await store.claim("A", e(3), 2, 0.3)  # the crashed claim was reclaimed

    run(store, go)


def test_concurrent_claims_never_exceed_the_budget(store) -> None:
    async def go(store):
        results = await asyncio.gather(*(store.claim("A", e(i, f"gw{i % 3}"), 7, 30) for i in range(50)))
        assert sum(results) == 7
        assert len((await store.snapshot(["A"]))["A"]) == 7

    run(store, go)


def test_redis_unreachable_raises_state_unavailable() -> None:
    from slogate.gateway.state.base import StateUnavailable

    async def go(s):
        with pytest.raises(StateUnavailable):
            await s.claim("A", e(1), 3, 30)
        with pytest.raises(StateUnavailable):
            await s.snapshot(["A"])

    run(lambda: RedisStore("redis://127.0.0.1:9/0", timeout_s=0.2), go)


def test_rate_limits_count_requests_and_tokens_per_window(store) -> None:
    async def go(store):
        assert [(await store.rate("k", 60, 3, 10, None))[0] for _ in range(4)] == [True, True, True, False]
        ok, retry = await store.rate("k", 60, 3, 10, None)
        assert not ok and 0 < retry <= 60
        assert (await store.rate("t", 60, None, 70, 100))[0]
        assert not (await store.rate("t", 60, None, 40, 100))[0]  # 110 > 100: refused, not counted
        assert (await store.rate("t", 60, None, 30, 100))[0]
        assert (await store.rate("other", 60, 3, 10, None))[0]  # subjects are separate

    run(store, go)


def test_prefixes_published_are_read_in_order_and_a_new_reader_gets_the_history(redis_url) -> None:
    prefix = f"t{next(_ns)}"
    big = (1 << 64) - 1  # hashes are unsigned 64-bit: the top bit must survive the round trip

    async def go() -> None:
        a, b = RedisStore(redis_url, prefix=prefix, timeout_s=5.0), RedisStore(redis_url, prefix=prefix, timeout_s=5.0)
        try:
            at, got = await b.read_prefixes("0", 100)
            assert got == [] and at == "0"
            await a.publish_prefixes("gw1", [("http://r1", (1, 2, big)), ("http://r2", (7,))])
            at, got = await b.read_prefixes(at, 100)
            assert got == [("gw1", "http://r1", [1, 2, big]), ("gw1", "http://r2", [7])]
            await a.publish_prefixes("gw1", [("http://r1", (3,))])
            at2, got = await b.read_prefixes(at, 1)  # from where it was: only the new one
            assert got == [("gw1", "http://r1", [3])] and at2 != at
            _, got = await b.read_prefixes("0", 2)  # a gateway that starts: the history, a batch at a time
            assert [g[2] for g in got] == [[1, 2, big], [7]]
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


def test_the_memory_store_shares_no_prefixes() -> None:
    async def go() -> None:
        s = MemoryStore()
        await s.publish_prefixes("gw1", [("http://r1", (1,))])
        assert await s.read_prefixes("0", 10) == ("0", [])

    asyncio.run(go())
