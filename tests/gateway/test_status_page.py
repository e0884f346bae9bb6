"""The gateway's /status page, opened in headless Chromium (Debian's ``chromium``) as a person would."""

from __future__ import annotations

import asyncio
import shutil
from html.parser import HTMLParser

import orjson
import pytest

from natsched.wire import subjects as S
from natsched.client.producer import make_request
from natsched.client.errors import Rejected
from tests.factories.gateway import KEYS, start_gateway

OPS = "sk-ops-status-0123456789"  # the one key that may read /status
from tests.factories.stack import start_stack

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")


class Page(HTMLParser):
    """Rendered DOM -> the text of each table row, per table id, and the meta refresh."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.paragraphs: dict[str, str] = {}
        self.refresh: str | None = None
        self._table: str | None = None
        self._row: list[str] | None = None
        self._cell: list[str] | None = None
        self._para: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "meta" and a.get("http-equiv") == "refresh":
            self.refresh = a.get("content")
        elif tag == "table":
            self._table = a.get("id") or "?"
            self.tables[self._table] = []
        elif tag == "tr" and self._table:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []
        elif tag == "p" and a.get("id"):
            self._para = a["id"]
            self.paragraphs[self._para] = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None and self._table:
            self.tables[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None
        elif tag == "p":
            self._para = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        elif self._para is not None:
            self.paragraphs[self._para] += data

    def rows(self, table: str) -> dict[str, dict[str, str]]:
        """{first cell: {column header: cell}} of one table."""
        header, *body = self.tables[table]
        return {row[0]: dict(zip(header, row)) for row in body}


def status_url(gw) -> str:
    """The page as its operator opens it: the status key as the password the browser sends
    (Basic credentials, asked for by the gateway's 401)."""
    return gw.url.replace("http://", f"http://ops:{OPS}@") + "/status"


async def chromium(*args: str, tmp_path) -> str:
    exe = shutil.which("chromium")
    assert exe, "Debian's chromium package is required (.ci/run installs it)"
    proc = await asyncio.create_subprocess_exec(
        exe, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()[-2000:]
    return out.decode()


@pytest.fixture
async def cluster(bus, nats_url):
    stack = await start_stack(nats_url, workers=2, time_scale=1.0)
    gw = await start_gateway(nats_url, status_refresh_s=3, keys={**KEYS, OPS: {"tenant": "ops", "status": True}})
    await gw.wait_for_workers(2)
    try:
        yield stack, gw
    finally:
        await gw.close()
        await stack.close()


async def test_status_page_shows_workers_tenants_queues_and_rejections(cluster, bus, tmp_path):
    stack, gw = cluster
    await bus.kv(S.BUCKET_QUOTAS).put(S.tenant_quota_key("acme"), orjson.dumps({"floor": 0.25, "cap": 9000}))
    await bus.kv(S.BUCKET_QUOTAS).put(S.KEY_CLUSTER_TOTAL, orjson.dumps(300))
    await bus.kv(S.BUCKET_QUOTAS).put("class.online.queue", orjson.dumps(0))
    for _ in range(100):
        if stack.admitter.total == 300 and stack.admitter.core.quotas.queue_limit("online") == 0:
            break
        await asyncio.sleep(0.05)
    hog = asyncio.create_task(stack.client.submit(make_request("acme", prompt_token_ids=list(range(100)),
                                                               max_tokens=50)))
    for _ in range(100):
        if stack.admitter.shared.usage.used:
            break
        await asyncio.sleep(0.02)
    with pytest.raises(Rejected):
        await stack.client.submit(make_request("acme", prompt_token_ids=list(range(100)), max_tokens=50))
    await hog

    page = Page()
    page.feed(await chromium("--dump-dom", status_url(gw), tmp_path=tmp_path))
    assert page.refresh == "3"  # it reloads itself
    workers = page.rows("workers")
    assert set(workers) == {"w1", "w2"}
    assert {w["state"] for w in workers.values()} == {"healthy"}
    assert all(w["heartbeat age"].endswith(" s") and w["KV use"].endswith("%") for w in workers.values())
    # the worker that served the hog shows its (uncached) ratio; the idle one a dash
    assert sorted(w["hit ratio"] for w in workers.values()) == ["0%", "–"]
    acme = page.rows("tenants")["acme"]
    assert (acme["floor"], acme["cap"], acme["usage"]) == ("75 (25%)", "9000", "0")
    assert page.rows("queues")["online"] == {"class": "online", "queued": "0", "limit": "0"}
    assert page.rows("rejections") == {"quota_exhausted": {"reason": "quota_exhausted", "count": "1"}}
    assert "of 300 runtime tokens" in page.paragraphs["summary"]


async def test_status_page_screenshot_renders(cluster, tmp_path):
    _, gw = cluster
    shot = tmp_path / "status.png"
    await chromium(f"--screenshot={shot}", "--window-size=1100,700", "--hide-scrollbars", status_url(gw),
                   tmp_path=tmp_path)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000  # a real picture, not an error stub
