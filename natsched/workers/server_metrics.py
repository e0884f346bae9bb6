"""An engine server's own Prometheus ``/metrics``, read as load, and smoothed like the in-process engine's.

Two flavours, with the names their projects document:

- **vLLM** (``vllm/v1/metrics/loggers.py``): gauges ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (0..1); counters
  ``vllm:num_preemptions``, ``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits`` (exposed
  with ``_total``); ``vllm:cache_config_info`` (an info gauge whose labels carry ``block_size``
  and ``num_gpu_blocks``) and, with LoRA on, ``vllm:lora_requests_info`` (labels
  ``running_lora_adapters`` / ``waiting_lora_adapters``: the adapters in the batch now).
- **SGLang** (``docs/references/production_metrics.md``): ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs``, ``sglang:token_usage`` (0..1), ``sglang:max_total_num_tokens``,
  ``sglang:cache_hit_rate`` (a gauge: SGLang publishes no prefix counters and documents no
  preemption counter, so those stay unknown). Tested against fixtures of that documented
  format only: a real SGLang server cannot run here (no CPU build).

Every family is summed over its label sets (one server may run several engines or models).
Parsing is the ``prometheus_client`` text parser; a page it cannot parse is a
:class:`MetricsError` (the scraper counts it as a failed scrape). Pure: text in, numbers out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from natsched.workers.errors import WorkerError

FLAVORS = ("vllm", "sglang")


class MetricsError(WorkerError):
    """A /metrics page that is not Prometheus text, or lacks the load gauges of its flavour."""


@dataclass(frozen=True)
class _Names:
    running: str
    waiting: str
    kv_usage: str
    preemptions: str | None = None  # counter family (the parser drops the _total suffix)
    prefix_queries: str | None = None
    prefix_hits: str | None = None
    hit_rate: str | None = None  # a gauge, where there are no counters
    total_tokens: str | None = None  # KV capacity in tokens
    cache_info: str | None = None  # info gauge with block_size / num_gpu_blocks labels
    lora_info: str | None = None


NAMES = {
    "vllm": _Names("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                   preemptions="vllm:num_preemptions", prefix_queries="vllm:prefix_cache_queries",
                   prefix_hits="vllm:prefix_cache_hits", cache_info="vllm:cache_config_info",
                   lora_info="vllm:lora_requests_info"),
    "sglang": _Names("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                     hit_rate="sglang:cache_hit_rate", total_tokens="sglang:max_total_num_tokens"),
}


@dataclass
class ServerLoad:
    """One scrape, as numbers (None: the server does not publish it)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0  # 0..1
    preemptions: int | None = None  # cumulative since the server started
    prefix_queries: int | None = None  # cumulative prompt tokens looked up in the prefix cache
    prefix_hits: int | None = None  # ... and found there
    hit_rate: float | None = None
    block_size: int | None = None
    kv_total_blocks: int | None = None
    kv_total_tokens: int | None = None
    process_start: float | None = None  # ``process_start_time_seconds``: a new value = a restarted server
    prefix_caching: bool | None = None  # vllm:cache_config_info's enable_prefix_caching
    active_adapters: set[str] = field(default_factory=set)  # LoRA adapters in the running/waiting batch


def parse_metrics(text: str, flavor: str = "vllm") -> ServerLoad:
    """A /metrics page -> :class:`ServerLoad`; :class:`MetricsError` when it is not a load page."""
    names = NAMES.get(flavor)
    if names is None:
        raise MetricsError(f"unknown server flavour {flavor!r} (one of {', '.join(FLAVORS)})")
    sums: dict[str, float] = {}
    labels: dict[str, list[dict[str, str]]] = {}
    latest: dict[str, dict[str, str]] = {}  # family -> labels of its highest-valued sample
    best: dict[str, float] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:  # by sample name: a counter's ``X_total`` counts as ``X``
                if s.name.endswith(("_created", "_bucket", "_sum", "_count")):
                    continue
                name = s.name[:-6] if s.name.endswith("_total") else s.name
                sums[name] = sums.get(name, 0.0) + float(s.value)
                labels.setdefault(name, []).append(dict(s.labels))
                if float(s.value) > best.get(name, float("-inf")):
                    best[name], latest[name] = float(s.value), dict(s.labels)
    except Exception as exc:  # the parser raises ValueError/TypeError/IndexError on garbage
        raise MetricsError(f"not Prometheus text: {type(exc).__name__}: {exc}") from None
    missing = [n for n in (names.running, names.waiting, names.kv_usage) if n not in sums]
    if missing:
        raise MetricsError(f"/metrics lacks {', '.join(missing)} (is this a {flavor} server?)")
    load = ServerLoad(running=sums[names.running], waiting=sums[names.waiting],
                      kv_usage=min(1.0, max(0.0, sums[names.kv_usage])))
    if names.preemptions and names.preemptions in sums:
        load.preemptions = int(sums[names.preemptions])
    if names.prefix_queries and names.prefix_queries in sums:
        load.prefix_queries = int(sums[names.prefix_queries])
    if names.prefix_hits and names.prefix_hits in sums:
        load.prefix_hits = int(sums[names.prefix_hits])
    if names.hit_rate and names.hit_rate in sums:
        load.hit_rate = sums[names.hit_rate]
    if names.total_tokens and names.total_tokens in sums:
        load.kv_total_tokens = int(sums[names.total_tokens])
    if "process_start_time_seconds" in sums:
        load.process_start = sums["process_start_time_seconds"]
    for info in labels.get(names.cache_info or "", []):
        load.block_size = _int(info.get("block_size")) or load.block_size
        load.kv_total_blocks = _int(info.get("num_gpu_blocks")) or load.kv_total_blocks
        if info.get("enable_prefix_caching") in ("True", "False"):
            load.prefix_caching = info["enable_prefix_caching"] == "True"
    if load.kv_total_blocks and load.block_size:
        load.kv_total_tokens = load.kv_total_blocks * load.block_size
    lora = latest.get(names.lora_info or "")
    if lora is not None:  # vLLM stamps the current label set with the time: the newest is now
        for key in ("running_lora_adapters", "waiting_lora_adapters"):
            load.active_adapters.update(a for a in (lora.get(key) or "").split(",") if a)
    return load


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "", "None") else None
    except ValueError:
        return None
