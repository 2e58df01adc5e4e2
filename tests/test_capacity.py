"""The learned SLO-safe budget on synthetic replicas whose inter-token time grows with the batch."""

from __future__ import annotations

import random

from router.capacity import CapacityLearner


def drive(learner: CapacityLearner, itl, seconds: int, target: float, offered: int = 10_000, rng: random.Random | None = None) -> list[int]:
    """Each second the replica holds min(budget, offered) sequences and reports 50 token gaps."""
    rng = rng or random.Random(0)
    budgets = []
    t0 = learner.last_update + 1 if learner.last_update > -1e9 else 0.0
    for t in (t0 + i for i in range(seconds)):
        n = min(learner.budget, offered)
        for _ in range(50):
            learner.observe(n, itl(n) * rng.uniform(0.9, 1.1))
        budgets.append(learner.update(float(t), target, n))
    return budgets


def test_finds_the_knee_of_a_replica_it_never_saw() -> None:
    # ITL = 5 ms + 2 ms per sequence; target 50 ms, margin 0.85 → 42.5 ms → 18 sequences.
    lr = CapacityLearner(cap=64, start=4)
    b = drive(lr, lambda n: 0.005 + 0.002 * n, 60, 0.050)
    assert 16 <= b[-1] <= 19, b[-10:]
    assert max(b[30:]) <= 21  # it does not keep overshooting once it knows
    a, slope = lr.fit  # type: ignore[misc]
    assert abs(slope - 0.002) < 0.0005 and abs(a - 0.005) < 0.006


def test_starting_at_the_cap_it_backs_off_an_overloaded_replica() -> None:
    lr = CapacityLearner(cap=64)  # a fixed budget of 64 until the replica shows it is slow
    b = drive(lr, lambda n: 0.005 + 0.002 * n, 40, 0.050)
    assert b[0] < 64 and b[-1] <= 19, b[:10]
    assert sum(x > 25 for x in b[10:]) == 0, b


def test_never_above_the_cap_and_never_below_one() -> None:
    lr = CapacityLearner(cap=10, start=4)
    assert max(drive(lr, lambda n: 0.001 * n, 40, 0.5)) == 10  # a fast replica: up to the cap, no further
    slow = CapacityLearner(cap=10, start=4)
    assert drive(slow, lambda n: 0.2 + 0.01 * n, 20, 0.05)[-1] == 1  # too slow for the target even alone: one at a time


def test_no_growth_without_load_and_recovery_when_the_engine_slows_down() -> None:
    lr = CapacityLearner(cap=64, start=4)
    assert drive(lr, lambda n: 0.005 + 0.002 * n, 20, 0.05, offered=3)[-1] <= 5  # never full: no reason to grow
    lr = CapacityLearner(cap=64, start=4)
    drive(lr, lambda n: 0.005 + 0.002 * n, 60, 0.05)
    before = lr.budget
    after = drive(lr, lambda n: 0.010 + 0.004 * n, 30, 0.05)  # a neighbour took half the machine
    assert after[-1] <= before // 2 + 2, (before, after[-5:])


def test_without_a_tbt_target_it_fills_up_to_the_cap_when_full() -> None:
    lr = CapacityLearner(cap=8, start=2)
    for t in range(10):
        lr.update(float(t), None, lr.budget)
    assert lr.budget == 8


def test_prefill_stalls_in_the_tail_do_not_read_as_overload() -> None:
    # One gap in ten carries another request's prefill and is 4× long: the p90 gap is far past
    # the target at any n ≥ 4, but the pace streams get (the mean, 1.3 × ITL) only past n ≈ 13.
    rng = random.Random(1)

    def spiky(n: int) -> float:
        return (0.005 + 0.002 * n) * (4.0 if rng.random() < 0.1 else 1.0)

    lr = CapacityLearner(cap=64)
    b = drive(lr, spiky, 60, 0.050)
    assert 11 <= b[-1] <= 15, b[-10:]
    assert min(b[20:]) >= 9, b  # no collapse towards one-at-a-time
