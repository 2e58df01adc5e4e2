"""The fleet's membership rules, without processes: who joins, drains, comes back and is
forgotten, and what a failed DNS lookup changes (nothing)."""

from __future__ import annotations

import asyncio

import pytest

from slogate.gateway.config import BackendConfig, DiscoveryConfig, GatewayConfig
from slogate.gateway.discovery import Discovery, ResolveError
from slogate.gateway.fleet import Fleet
from slogate.gateway.metrics import Metrics
from slogate.router.request import SLO, Request


def _fleet(*urls: str) -> Fleet:
    return Fleet(GatewayConfig.model_validate({"backends": [{"url": u, "models": ["m"], "budget": 20} for u in urls]}), Metrics())


def test_replicas_slow_start_alone_and_beside_other_gateways_no_lower_than_they_hold() -> None:
    alone = _fleet("http://a:1")
    assert [b.view.budget for b in alone.backends] == [8]  # slow start: doubles while full and fast
    # With shared state other gateways may hold more than 8 there already: a gateway held at 8
    # would claim nothing and measure nothing to grow by, so a sync lifts it to what they hold.
    shared = Fleet(GatewayConfig.model_validate({"backends": [{"url": "http://a:1", "models": ["m"], "budget": 20}],
                                                 "state": {"kind": "redis"}}), Metrics())
    b = shared.backends[0]
    assert b.view.budget == 8 and b.learner is not None and b.learner.growing
    b.learner.hold_at_least(12)
    assert b.learner.budget == 12
    b.learner.hold_at_least(30)
    assert b.learner.budget == 20  # never above the cap
    off = Fleet(GatewayConfig.model_validate({"backends": [{"url": "http://a:1", "models": ["m"], "budget": 20}],
                                              "capacity": {"slow_start": False}}), Metrics())
    assert [b.view.budget for b in off.backends] == [20]
    for begin, budget in ((16, 16), (64, 20)):  # where slow start begins, never above the cap
        fleet = Fleet(GatewayConfig.model_validate({"backends": [{"url": "http://a:1", "models": ["m"], "budget": 20}],
                                                    "capacity": {"slow_start_budget": begin, "on_stalls": "cut"}}), Metrics())
        lr = fleet.backends[0].learner
        assert lr is not None and fleet.backends[0].view.budget == budget and lr.on_stalls == "cut"


def test_reconcile_joins_drains_revives_and_reaps() -> None:
    f = _fleet("http://a:1", "http://b:1")
    a, b = f.backends
    assert f.reconcile([a.cfg, BackendConfig(url="http://c:1", models=["m"])]) is True
    c = f.named("http://c:1")
    assert c is not None and not c.view.healthy  # no traffic before a health check
    assert f.named("http://c:1/v1/") is c and f.named(c.name) is c and f.named("http://d:1") is None  # as an SDK's base_url
    assert b.state == "draining" and f.active() == [a, c]
    # b comes back before it finished leaving (a flapping pod): the same replica, active again
    assert f.reconcile([a.cfg, b.cfg, c.cfg]) is True
    assert b.state == "active" and len(f.backends) == 3
    f.reconcile([a.cfg, c.cfg])
    req = Request(1, 0.0, 10, SLO.deadline(5.0))
    b.view.claim(req, 0.0)  # a request still runs there
    assert f.reap(set()) == [] and b in f.backends
    b.view.release(req, 1.0)
    f.update_budgets()  # the learners have been told of b's request
    assert f.reap({b.view.rid}) == []  # a ticket still names it
    assert f.reap(set()) == [b]
    assert b not in f.backends and b.view.rid not in f.by_rid
    a.view.claim(Request(2, 1.0, 10, SLO.deadline(5.0)), 1.0)
    f.update_budgets()
    # One placed since b left, whose own claims no longer count against the replicas left (none
    # health-checked here: shared over 1). Before: 0, the replica that left hid a's request.
    assert a.learner is not None and a.learner._admitted_now == 1.0
    assert len({x.view.rid for x in f.backends} | {b.view.rid}) == 3  # ids are never reused


def test_kept_replica_takes_new_settings_and_drained_stays_out() -> None:
    f = _fleet("http://a:1", "http://b:1")
    a, b = f.backends
    f.reconcile([a.cfg.model_copy(update={"budget": 5, "api_key": "k"}), b.cfg])
    assert a.learner is not None and a.learner.cap == 5 and a.learner.budget <= 5
    assert a.headers == {"authorization": "Bearer k"}
    f.drain(b, leave=False)
    f.reconcile([a.cfg, b.cfg])  # still configured: an operator's drain is not undone by a reload
    assert b.state == "drained" and f.active() == [a]
    f.undrain(b)
    assert f.active() == [a, b]


def test_a_joining_replica_starts_at_its_peers_budget_not_the_cap() -> None:
    f = _fleet("http://a:1", "http://b:1")
    for x, budget in zip(f.backends, (6, 8), strict=True):
        x.view.budget = budget
    c = f.add(BackendConfig(url="http://c:1", models=["m"], budget=48))
    assert c.learner is not None and c.learner.budget == 8 and c.view.budget == 8


def test_a_failed_lookup_keeps_the_replicas_found_last() -> None:
    d = Discovery(DiscoveryConfig())
    answers: list[list[tuple[str, int]] | Exception] = [[("10.0.0.1", 80), ("10.0.0.2", 80)], ResolveError("SERVFAIL"), [("10.0.0.2", 80)]]

    async def fake(host: str, port: int) -> list[tuple[str, int]]:
        ans = answers.pop(0)
        if isinstance(ans, Exception):
            raise ans
        return ans

    d.resolver.addresses = fake  # type: ignore[method-assign]
    entries = [BackendConfig(url="dns+http://svc:80", name="svc", budget=7), BackendConfig(url="http://static:1")]

    async def run() -> list[list[str]]:
        return [[r.url for r in await d.replicas(entries)] for _ in range(3)]

    first, failed, shrunk = asyncio.run(run())
    assert first == ["http://10.0.0.1:80", "http://10.0.0.2:80", "http://static:1"]
    assert failed == first
    assert shrunk == ["http://10.0.0.2:80", "http://static:1"]


@pytest.mark.parametrize("url", ["dns+http://svc", "dns+ftp://svc:80", "dns+http://svc:80/api", "dnssrv+http://"])
def test_bad_discovered_urls_are_refused_at_load(url: str) -> None:
    with pytest.raises(ValueError):
        BackendConfig(url=url)


def test_a_gateway_joining_others_in_slow_start_begins_at_what_they_hold(redis_url: str) -> None:
    """Other gateways hold 12 requests on the replica: the first sync lifts this gateway's slow
    start from 8 to 12, so it can claim a slot when one frees (held at 8 it never could)."""
    import uuid

    from slogate.gateway.state.base import Entry
    from slogate.gateway.statesync import StateSync

    cfg = GatewayConfig.model_validate({"backends": [{"url": "http://a:1", "models": ["m"], "budget": 20}],
                                        "state": {"kind": "redis", "url": redis_url, "prefix": f"join-{uuid.uuid4().hex[:8]}"}})
    fleet = Fleet(cfg, Metrics())
    b = fleet.backends[0]

    async def go() -> None:
        sync = StateSync(cfg.state, fleet, Metrics(), list)
        try:
            for i in range(12):
                await sync.store.claim("http://a:1", Entry(f"o{i}", "other", "decode", 100, 50.0, 0.0), 20, 30.0)
            assert b.view.budget == 8
            await sync.sync()
            assert b.view.inflight == 12 and b.view.budget == 12 and b.learner is not None and b.learner.budget == 12
        finally:
            await sync.store.close()

    asyncio.run(go())


def test_a_dispatch_decided_while_the_store_fails_is_still_shared_later(redis_url: str) -> None:
    """A claim that fails on a store error is re-judged locally; its prompt still goes to the other
    gateways' prefix indexes once the store answers (queued, not lost)."""
    import uuid

    from slogate.gateway.admission import Ticket
    from slogate.gateway.state.base import StateUnavailable
    from slogate.gateway.statesync import StateSync

    cfg = GatewayConfig.model_validate({"backends": [{"url": "http://a:1", "models": ["m"], "budget": 20}],
                                        "state": {"kind": "redis", "url": redis_url, "prefix": f"fail-{uuid.uuid4().hex[:8]}"}})
    fleet = Fleet(cfg, Metrics())
    rid = fleet.backends[0].view.rid

    async def go() -> None:
        sync = StateSync(cfg.state, fleet, Metrics(), list)

        async def broken(*_a: object) -> bool:
            raise StateUnavailable("down")

        real_claim, sync.store.claim = sync.store.claim, broken  # type: ignore[method-assign]
        try:
            req = Request(1, 0.0, 100, SLO.latency(1.0, 0.05), prefix=(11, 22))
            assert await sync.confirm(Ticket(req, asyncio.get_running_loop().create_future(), 10.0, replica=rid)) is True
            assert sync.degraded and list(sync._prefixes_out) == [("http://a:1", (11, 22))]
            sync.store.claim = real_claim  # type: ignore[method-assign]
            await sync.sync()  # the store answers again: the queue goes out
            _, got = await sync.store.read_prefixes("0", 10)
            assert got == [(sync.instance, "http://a:1", [11, 22])] and not sync._prefixes_out
        finally:
            await sync.store.close()

    asyncio.run(go())


def test_the_gateway_re_decides_budgets_often_while_a_learner_is_quick_after_slow_start() -> None:
    """Out of reach (or just after a cut) a replica's budget doubles between the once-a-second
    health checks: the gateway's quick loop keeps calling once slow start is over (it used to
    end with slow start, so each doubling waited a second)."""
    from slogate.gateway.handler import Gateway

    async def run() -> int:
        gw = Gateway(GatewayConfig.model_validate({"backends": [{"url": "http://a:1", "models": ["m"], "budget": 64}]}))
        b = gw.fleet.backends[0]
        lr = b.learner
        assert lr is not None
        lr._growing, lr._since_cut, lr.out_of_reach = False, 10, True  # slow start over; found out of reach
        b.view.healthy = True
        for i in range(b.view.budget):
            b.view.claim(Request(i, 0.0, 10, SLO.deadline(5.0)), 0.0)  # full
        calls = 0

        def count() -> None:
            nonlocal calls
            calls += 1

        gw.fleet.update_budgets = count  # type: ignore[method-assign]
        task = asyncio.create_task(gw._quick_loop())
        await asyncio.sleep(0.55)
        lr.out_of_reach = False  # reached: once a second is enough again
        seen = calls
        await asyncio.sleep(0.3)
        task.cancel()
        assert calls - seen <= 1
        return seen

    assert asyncio.run(run()) >= 3
