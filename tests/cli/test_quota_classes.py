"""``natsched quota set --class C --class-limit N`` and the lending knobs: written, shown, and
refused with a clear error (nothing written) when bad."""

from __future__ import annotations

import orjson

from natsched.admitter.quotas import Quotas
from natsched.wire import subjects as S
from tests.cli.test_polish import natsched


async def stored(bus) -> dict[str, bytes]:
    kv = bus.kv(S.BUCKET_QUOTAS)
    return {k: (await kv.get(k))[0] for k in await kv.keys()}


async def test_class_limits_are_set_shown_and_removed(bus, nats_url):
    code, out, err = await natsched("quota", "set", "--class", "batch", "--class-limit", "600000",
                                    "--nats-url", nats_url)
    assert (code, out) == (0, "class limit batch: unset -> 600000\n"), err
    code, out, err = await natsched("quota", "set", "--class", "online", "--class-limit", "400000",
                                    "--queue-limit", "50", "--set", "admission.lend_share=0.25",
                                    "--nats-url", nats_url)
    assert code == 0, err
    assert out.splitlines() == ["queue limit online: 1000 -> 50", "class limit online: unset -> 400000",
                                "setting admission.lend_share: unset -> 0.25"]
    quotas, errors = Quotas.from_kv(await stored(bus))
    assert errors == [] and quotas.class_limits == {"online": 400000, "batch": 600000}
    code, out, _ = await natsched("quota", "show", "--nats-url", nats_url)
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    assert rows["online"] == ["online", "400000", "0", "0", "0", "50"]
    assert rows["batch"] == ["batch", "600000", "0", "0", "0", "10000"]
    assert rows["offline"] == ["offline", "-", "0", "0", "0", "0"]
    code, out, _ = await natsched("quota", "show", "--json", "--nats-url", nats_url)
    view = orjson.loads(out)["classes"]
    assert view["batch"] == {"limit": 600000, "used": 0, "borrowed": 0, "borrowed_from": {}, "lent": 0,
                             "lent_to": {}, "queue_limit": 10000}
    code, out, _ = await natsched("quota", "set", "--class", "batch", "--class-limit", "-1", "--nats-url", nats_url)
    assert (code, out) == (0, "class limit batch: 600000 -> unset\n")
    assert "class.batch.limit" not in {k for k, v in (await stored(bus)).items() if v}


async def test_bad_class_limits_and_lending_knobs_are_refused_and_nothing_is_written(bus, nats_url):
    before = await stored(bus)
    for args, says in [
        (("--class", "vip", "--class-limit", "5"), "unknown class 'vip'"),
        (("--class-limit", "5"), "--class goes with"),
        (("--class", "batch"), "--class goes with"),
        (("--set", "admission.lend_share=1.5"), "lend_share must be between 0 and 1"),
        (("--set", 'admission.lend_to=["vip"]'), "lend_to names unknown classes"),
        (("--set", "admission.lend_to=online"), "admission.lend_to must be a list of strings"),
    ]:
        code, out, err = await natsched("quota", "set", *args, "--nats-url", nats_url)
        assert code == 1 and out == "" and says in err, (args, err)
        assert "refused, nothing written" in err
    assert await stored(bus) == before
