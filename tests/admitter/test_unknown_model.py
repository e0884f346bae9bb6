"""An unknown model is refused at admission at once, with the served models named (issue 25:
it used to wait out the router's 10 s and fail as ``no_worker``)."""

import time

import pytest

from natsched.admitter.policy import REJECT, AdmitterCore
from natsched.client.errors import Rejected
from natsched.client.producer import make_request
from tests.factories.core import wait_for
from tests.factories.stack import start_stack


def test_the_core_refuses_a_model_no_worker_serves_and_names_the_served_ones():
    core = AdmitterCore()
    req = make_request("t", "hello", model="nope", max_tokens=4)
    assert core.evaluate(req, time.time()).decision != REJECT  # nothing heard yet: not judged
    core.set_served_models(frozenset({"tiny", "llama"}))
    dec = core.evaluate(req, time.time())
    assert (dec.decision, dec.reason) == (REJECT, "unknown_model")
    assert "'nope'" in dec.message and "served: llama, tiny" in dec.message
    assert core.evaluate(make_request("t", "hello", model="tiny", max_tokens=4), time.time()).decision != REJECT
    core.set_served_models(frozenset())  # every worker forgotten: back to "not known"
    assert core.evaluate(req, time.time()).decision != REJECT


async def test_submit_with_an_unknown_model_is_refused_at_once(nats_url):
    stack = await start_stack(nats_url, workers=1)
    try:
        assert await wait_for(lambda: stack.admitter.core.served_models == frozenset({"default"}))
        with pytest.raises(Rejected) as err:
            await stack.client.submit(make_request("t", "hello", model="nope", max_tokens=4))
        assert err.value.reason == "unknown_model"  # the admitter's, not the router's no_worker
        assert "served: default" in str(err.value)
        ok = await stack.client.submit(make_request("t", "hello", model="default", max_tokens=4))
        assert ok.status == "completed"
    finally:
        await stack.close()


async def test_a_model_whose_workers_went_silent_is_forgotten(nats_url):
    stack = await start_stack(nats_url, workers=1)
    try:
        adm = stack.admitter
        assert await wait_for(lambda: adm.core.served_models == frozenset({"default"}))
        adm.refresh_served_models(time.time() + adm.settings.model_memory_s + 1)
        assert adm.core.served_models is None
    finally:
        await stack.close()


async def test_a_lora_adapter_a_fronted_server_serves_is_admitted(nats_url):
    """A worker fronting ``vllm serve --lora-modules ada=...`` names the adapter in its heartbeat's
    ``served``: the adapter is a served model for admission (it was refused as unknown before)."""
    from natsched.wire import subjects as S
    from natsched.wire.schema import Heartbeat, ServedModel, WorkerId

    stack = await start_stack(nats_url, workers=1)
    try:
        adm = stack.admitter
        assert await wait_for(lambda: adm.core.served_models == frozenset({"default"}))
        hb = Heartbeat(worker=WorkerId("lora1"), seq=1, ts=time.time(), model="default", interval=0.2,
                       served=[ServedModel(id="default"), ServedModel(id="ada", parent="default")])
        await stack.client.bus.publish(S.heartbeat(WorkerId("lora1")), hb)
        assert await wait_for(lambda: adm.core.served_models == frozenset({"default", "ada"}))
        assert adm.core.evaluate(make_request("t", "hello", model="ada", max_tokens=4), time.time()).decision != REJECT
        dec = adm.core.evaluate(make_request("t", "hello", model="bob", max_tokens=4), time.time())
        assert dec.reason == "unknown_model" and "served: ada, default" in dec.message
    finally:
        await stack.close()


async def test_a_served_model_no_worker_can_take_fails_naming_who_serves_it(nats_url):
    """Past admission (the model is served), the router's ``no_worker`` says which workers serve
    the model and in what state (it used to say only "no healthy worker")."""
    from natsched.client.errors import RequestFailed
    from natsched.wire import subjects as S
    from natsched.wire.schema import Control, WorkerId

    stack = await start_stack(nats_url, workers=1, no_worker_wait_s=0.5)
    try:
        await stack.client.bus.publish(S.control(WorkerId("w1")), Control(kind="drain", ts=time.time(), by="test"))
        assert await wait_for(lambda: stack.router.core.workers["w1"].state == "quiescing")
        with pytest.raises(RequestFailed) as err:
            await stack.client.submit(make_request("t", "hello", model="default", max_tokens=4))
        assert err.value.reason == "no_worker"
        assert "no worker serving model 'default' can take it now (w1 quiescing)" in str(err.value)
    finally:
        await stack.close()
