"""The load window heartbeats report (``natsched.workers.vllm_stats``): a mean over the last
seconds, not the last sample; and the vLLM stat logger that feeds it, given vLLM's own stats
objects (real vLLM classes; no engine needed to build them)."""

from __future__ import annotations

from natsched.workers.vllm_stats import LoadSample, LoadWindow, stat_logger_factory


def test_the_window_is_the_mean_of_its_last_seconds_not_the_last_sample():
    w = LoadWindow(window_s=2.0)
    for t, running in ((0.0, 2), (0.5, 4), (1.0, 6), (1.5, 8)):
        w.add(LoadSample(running=running, waiting=running / 2, kv_usage=running / 10), now=t)
    s = w.smoothed(now=1.5)
    assert (s.running, s.waiting) == (5.0, 2.5) and abs(s.kv_usage - 0.5) < 1e-9
    # two seconds on, the first two samples have left the window
    w.add(LoadSample(running=10), now=2.6)
    assert w.smoothed(now=2.6).running == (6 + 8 + 10) / 3


def test_an_idle_engine_keeps_its_last_sample_and_memory_is_bounded():
    w = LoadWindow(window_s=1.0, max_samples=8)
    for i in range(100):
        w.add(LoadSample(running=i), now=i * 0.001)
    assert len(w._samples) == 8
    assert w.smoothed(now=50.0).running == 99  # no step for a long time: the last one stands
    assert LoadWindow().smoothed(now=1.0) == LoadSample()


def test_vllms_stat_logger_feeds_load_preemptions_and_prefix_lookups():
    from vllm.v1.metrics.stats import IterationStats, PrefixCacheStats, SchedulerStats

    w = LoadWindow(window_s=60.0)
    logger = stat_logger_factory(w)(None, 0)
    for queries, hits in ((64, 32), (96, 96)):
        sched = SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, num_skipped_waiting_reqs=1,
                               kv_cache_usage=0.5, prefix_cache_stats=PrefixCacheStats(queries=queries, hits=hits))
        it = IterationStats()
        it.num_preempted_reqs = 2
        logger.record(sched, it)
    s = w.smoothed()
    assert (s.running, s.waiting, s.kv_usage) == (3.0, 2.0, 0.5)
    assert (w.preemptions, w.prefix_queries, w.prefix_hits) == (4, 160, 128)
    garbled = type("Garbled", (), {"num_running_reqs": 1, "prefix_cache_stats": "not stats"})()
    logger.record(garbled, None)  # stats it cannot read are skipped, never raised into vLLM's loop
    assert w.prefix_queries == 160
