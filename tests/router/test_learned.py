"""The learned cost model: recovers known coefficients, shrugs off outliers, refuses bad reports."""

from __future__ import annotations

import math
import random

import pytest

from natsched.router.costmodel import CostModel
from natsched.router.learned import CostBook, LearnSettings, Sample, calibrated_prior

#: a worker 4x slower than the fixed model at prefill, with its own attention, overhead and decode terms
TRUE = CostModel(prefill_tokens_per_s=8_000.0, attention_ctx_tokens=60_000.0, ttft_overhead_s=0.004,
                 decode_step_s=0.011, decode_s_per_1k_ctx=0.00012, decode_s_per_seq=0.00002)


def samples(n: int, rng: random.Random, noise: float = 0.0):
    """Synthetic completions of TRUE: random prompts, caches, batches (no queue ahead)."""
    for _ in range(n):
        u = rng.randint(1, 40) * 256
        c = rng.choice([0, 0, 1024, 8192])
        batch, kv = rng.randint(1, 64), rng.randint(1_000, 200_000)
        ttft = TRUE.first_token_s(u, c) * (1 + noise * rng.gauss(0, 1))
        tpot = TRUE.step_s(kv, batch) * (1 + noise * rng.gauss(0, 1))
        yield Sample(u, c, ttft, tpot, batch=batch, batch_kv=kv)


def feed(book: CostBook, w: str, it, t0: float = 0.0, dt: float = 0.05) -> float:
    now = t0
    for s in it:
        assert book.observe(w, s, now) is None
        now += dt
    return now


def rel(a: float, b: float) -> float:
    return abs(a - b) / b


def test_known_coefficients_are_recovered_from_synthetic_samples():
    book = CostBook()
    feed(book, "w", samples(400, random.Random(1)))
    got = book.of("w")
    assert rel(got.prefill_tokens_per_s, TRUE.prefill_tokens_per_s) < 0.02
    assert rel(got.attention_ctx_tokens, TRUE.attention_ctx_tokens) < 0.1
    assert rel(got.decode_step_s, TRUE.decode_step_s) < 0.05
    assert rel(got.decode_s_per_1k_ctx, TRUE.decode_s_per_1k_ctx) < 0.1
    # what routing uses: the estimates, not the coefficients, are what must be right
    for u, c in ((512, 0), (4096, 8192), (16_000, 0)):
        assert rel(got.first_token_s(u, c), TRUE.first_token_s(u, c)) < 0.03
    assert book.describe("w")["cost_learned"] == 1.0


def test_noisy_samples_converge_within_a_few_hundred_completions():
    book = CostBook()
    rng = random.Random(2)
    feed(book, "w", samples(300, rng, noise=0.1))
    got = book.of("w")
    errs = sorted(rel(got.first_token_s(s.uncached, s.cached), TRUE.first_token_s(s.uncached, s.cached))
                  for s in samples(200, rng))
    assert errs[len(errs) // 2] < 0.05


def test_outliers_do_not_drag_the_fit():
    clean, dirty = CostBook(), CostBook()
    rng = random.Random(3)
    data = list(samples(400, rng, noise=0.05))
    feed(clean, "w", data)
    spoiled = [Sample(s.uncached, s.cached, s.ttft * (30 if i % 10 == 0 else 1), s.tpot, batch=s.batch,
                      batch_kv=s.batch_kv) for i, s in enumerate(data)]  # every 10th: a 30x stall
    # (without the Huber weights the fit is several times off here)
    feed(dirty, "w", spoiled)
    ref = TRUE.first_token_s(4096, 0)
    assert rel(dirty.of("w").first_token_s(4096, 0), ref) < 0.15
    assert rel(clean.of("w").first_token_s(4096, 0), ref) < 0.05


def test_a_worker_that_reports_nothing_keeps_its_prior():
    book = CostBook()
    assert book.of("silent") == book.prior_cost  # the fixed model, plus one step of first-token overhead
    assert book.prior_cost.prefill_tokens_per_s == book.base.prefill_tokens_per_s
    assert book.describe("silent")["cost_learned"] == 0.0
    prior = calibrated_prior(book.base, ttft_s=0.05, tpot_s=0.02, prompt_tokens=256)
    book.set_prior("calibrated", prior)
    got = book.of("calibrated")
    assert rel(got.first_token_s(256, 0), 0.05) < 0.01 and rel(got.step_s(256, 1), 0.02) < 0.01
    assert book.describe("calibrated")["cost_calibrated"] == 1.0


def test_a_changed_worker_is_relearned_within_a_minute():
    book = CostBook()
    rng = random.Random(4)
    now = feed(book, "w", samples(600, rng), dt=0.1)  # a minute of the TRUE worker, 10 completions/s
    slowed = (Sample(s.uncached, s.cached, s.ttft * 3, s.tpot * 3, batch=s.batch, batch_kv=s.batch_kv)
              for s in samples(600, rng))
    feed(book, "w", slowed, t0=now, dt=0.1)  # then a minute at a third of its speed
    assert rel(book.of("w").first_token_s(4096, 0), 3 * TRUE.first_token_s(4096, 0)) < 0.1


def test_an_idle_worker_keeps_what_it_learned():
    book = CostBook()
    now = feed(book, "w", samples(300, random.Random(5)))
    (s,) = samples(1, random.Random(6))
    book.observe("w", s, now + 3600)  # an hour later: one more sample, not a return to the prior
    assert rel(book.of("w").prefill_tokens_per_s, TRUE.prefill_tokens_per_s) < 0.05


@pytest.mark.parametrize("bad, reason", [
    (Sample(1000, 0, -0.5, 0.01), "bad_ttft"),
    (Sample(1000, 0, math.nan, 0.01), "bad_ttft"),
    (Sample(1000, 0, math.inf, 0.01), "bad_ttft"),
    (Sample(1000, 0, 0.0, 0.01), "bad_ttft"),
    (Sample(1000, 0, 0.1, -0.01), "bad_tpot"),
    (Sample(1000, 0, 0.1, math.nan), "bad_tpot"),
    (Sample(1000, 0, 1e5, 0.01), "absurd_ttft"),
    (Sample(10_000_000, 0, 0.01, 0.01), "absurd_rate"),  # a billion tokens per second
    (Sample(1000, 0, 0.1, 1e-9), "absurd_tpot"),
    (Sample(-5, 0, 0.1, 0.01), "bad_counts"),
    (Sample(1000, math.nan, 0.1, 0.01), "bad_counts"),
])
def test_bad_reports_are_refused_counted_and_never_poison_the_model(bad, reason):
    book = CostBook()
    feed(book, "w", samples(200, random.Random(7)))
    before = book.of("w")
    for _ in range(50):
        assert book.observe("w", bad, 100.0) == reason
    assert book.refused[reason] == 50
    assert book.of("w") == before


def test_statistics_of_two_replicas_add_up_to_one_fit():
    rng = random.Random(8)
    data = list(samples(400, rng, noise=0.05))
    a, b, both = CostBook(), CostBook(), CostBook()
    feed(a, "w", data[::2])
    feed(b, "w", data[1::2], t0=0.025)
    feed(both, "w", data)
    a.merge("w", "b", b.export("w"))
    b.merge("w", "a", a.export("w"))
    for u in (512, 8192):
        # each replica now solves its own statistics plus the other's: the same fit on all samples
        assert rel(a.of("w").first_token_s(u, 0), b.of("w").first_token_s(u, 0)) < 0.02
        assert rel(a.of("w").first_token_s(u, 0), TRUE.first_token_s(u, 0)) < 0.05


@pytest.mark.parametrize("raw", [
    "not a map", {"prefill": {"a": [[1, 2]], "b": [1], "n": 1}},
    {"prefill": {"a": [[math.nan] * 4] * 4, "b": [0] * 4, "n": 1}, "decode": {"a": [[0] * 3] * 3, "b": [0] * 3, "n": 1}},
    {"prefill": {"a": [[-1, 0, 0, 0]] + [[0] * 4] * 3, "b": [0] * 4, "n": 1},
     "decode": {"a": [[0] * 3] * 3, "b": [0] * 3, "n": 1}},
])
def test_malformed_shared_statistics_are_refused(raw):
    book = CostBook()
    with pytest.raises(ValueError):
        book.merge("w", "other", raw)
    assert book.of("w") == book.prior_cost and book.workers() == []


def test_disabled_learning_is_the_fixed_model():
    book = CostBook(settings=LearnSettings(enabled=False))
    feed(book, "w", samples(100, random.Random(9)))
    assert book.of("w") == book.base


def pooled_book(members: int, each: int, slow: dict[str, float] | None = None) -> CostBook:
    """``members`` workers of one (model, deployment) group, ``each`` samples of TRUE apiece
    (``slow``: a worker's samples ``factor`` x slower)."""
    book, rng = CostBook(), random.Random(7)
    ws = [f"w{i}" for i in range(members)]
    for w in ws:
        book.set_group(w, "m/l4")
    for w in ws:
        f = (slow or {}).get(w, 1.0)
        feed(book, w, (Sample(s.uncached, s.cached, s.ttft * f, s.tpot * f, batch=s.batch, batch_kv=s.batch_kv)
                       for s in samples(each, rng)))
    for w in ws:
        book.of(w)  # routing solves; the yardstick reads what that solve used
    return book


def test_a_member_routed_on_its_groups_fit_is_judged_by_the_groups_samples():
    book = pooled_book(4, 15)
    assert 10 <= book.samples("w0") < 50
    assert book.yardstick_samples("w0", min_own=10, min_members=3) == pytest.approx(
        sum(book.samples(w) for w in ("w0", "w1", "w2", "w3")))
    assert book.group_members("w0") == frozenset({"w0", "w1", "w2", "w3"})


def test_a_new_member_a_small_group_and_a_deviating_member_are_judged_by_their_own_samples():
    few = pooled_book(4, 5)  # not yet shown it runs like the group
    assert few.yardstick_samples("w0", min_own=10, min_members=3) == few.samples("w0")
    pair = pooled_book(2, 15)  # no peers to compare with
    assert pair.yardstick_samples("w0", min_own=10, min_members=3) == pair.samples("w0")
    odd = pooled_book(4, 40, slow={"w3": 3.0})  # another GPU under the same name
    assert odd.yardstick_samples("w3", min_own=10, min_members=3) == odd.samples("w3")
    assert odd.yardstick_samples("w0", min_own=10, min_members=3) > odd.samples("w0")
    assert CostBook().yardstick_samples("nobody", min_own=10, min_members=3) == 0.0
