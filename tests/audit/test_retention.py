"""Retention: stream limits are settings an operator changes with one command, and they stick."""

import orjson

from natsched.wire import subjects as S
from natsched.bus.provision import DAY, GiB, ProvisionSettings, fmt_age, fmt_size, parse_duration, parse_size, stored_settings
from tests.client.test_batch_submit import cli2


async def test_set_changes_the_stream_now_and_is_stored_for_later_provisioning(bus, nats_url):
    done = cli2(nats_url, "retention", "set", "REQUESTS", "--max-age", "14d", "--max-bytes", "2GiB")
    assert done.returncode == 0, done.stderr
    assert "REQUESTS now keeps 14d / 2 GiB (was 7d / 1 GiB)" in done.stdout
    info = await bus.stream(S.STREAM_REQUESTS).info()
    assert (info.max_age_s, info.max_bytes) == (14 * DAY, 2 * GiB)
    assert (await bus.stored_overrides())[S.STREAM_REQUESTS].max_age_s == 14 * DAY
    await bus.provision()  # what a restarting service does
    assert (await bus.stream(S.STREAM_REQUESTS).info()).max_age_s == 14 * DAY
    shown = cli2(nats_url, "retention", "show", "--json")
    rows = {r["stream"]: r for r in orjson.loads(shown.stdout)}
    assert rows["REQUESTS"]["set"] and not rows["DECISIONS"]["set"] and rows["jobs"]["max_age_s"] == 30 * DAY


async def test_jobs_bucket_and_outcomes_limits_stick_across_provisioning(bus, nats_url):
    assert cli2(nats_url, "retention", "set", "jobs", "--max-age", "60d").returncode == 0
    assert cli2(nats_url, "retention", "set", "outcomes", "--max-bytes", "256MiB").returncode == 0
    await bus.provision(jobs=True)
    assert (await bus.stream("KV_jobs").info()).max_age_s == 60 * DAY
    assert (await bus.stream(S.STREAM_OUTCOMES).info()).max_bytes == 256 * 1024 * 1024


async def test_bad_input_is_refused_and_nothing_changes(bus, nats_url):
    for args, why in ((("NOPE", "--max-age", "1d"), "unknown stream"), (("REQUESTS", "--max-age", "soon"), "duration"),
                      (("REQUESTS", "--max-bytes", "-5"), "must be > 0"), (("REQUESTS",), "give --max-age")):
        done = cli2(nats_url, "retention", "set", *args)
        assert done.returncode == 1 and why in done.stderr, done.stderr
    assert await bus.stored_overrides() == {}
    assert (await bus.stream(S.STREAM_REQUESTS).info()).max_age_s == 7 * DAY


async def test_a_corrupted_stored_value_is_ignored_not_fatal(bus):
    await bus.kv(S.BUCKET_CONFIG).put(S.KEY_RETENTION, b'{"REQUESTS": {"max_age_s": "forever"}}')
    assert await bus.stored_overrides() == {}
    settings = await stored_settings(bus.js)
    assert settings.limits[S.STREAM_REQUESTS] == ProvisionSettings().limits[S.STREAM_REQUESTS]


def test_sizes_and_durations():
    assert parse_duration("90") == 90 and parse_duration("2w") == 14 * DAY
    assert parse_size("4GiB") == 4 * GiB and parse_size("1.5 KiB") == 1536 and parse_size("2GB") == 2 * 10**9


def test_ages_and_sizes_are_written_as_they_are_given():
    for text in ("90s", "15m", "12h", "7d"):
        assert fmt_age(parse_duration(text)) == text
    assert fmt_age(90.5) == "90.5s" and fmt_age(0) == "ever"
    assert fmt_size(parse_size("4GiB")) == "4 GiB" and fmt_size(parse_size("1.5 KiB")) == "1.5 KiB"
    assert fmt_size(512) == "512 B" and fmt_size(-1) == "unlimited bytes"
