"""What a routing policy may be given at construction: shared knowledge, never I/O.

:class:`natsched.router.core.RouterCore` builds one :class:`PolicyDeps` and hands it to every policy it
makes (the live one and a canary), so all of them read the same prefix index and cost models and a
benchmark compares like with like. ``cost`` is the fixed model (capacities, defaults); ``costs``
gives each worker's own, learned one (:mod:`natsched.router.learned`): a policy that reasons in
seconds asks ``deps.costs.of(worker_id)``. Also the helpers for policy weights and tie-breaking.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from natsched.router.costmodel import CostModel
from natsched.router.errors import ConfigError
from natsched.router.index import PrefixIndex
from natsched.router.learned import CostBook, LearnSettings
from natsched.router.policy import WorkerView


@dataclass
class PolicyDeps:
    index: PrefixIndex = field(default_factory=PrefixIndex)
    cost: CostModel = field(default_factory=CostModel)
    block_tokens: int = 32  # tokens per block of RouteRequest.hashes (512 for Mooncake traces)
    costs: CostBook | None = None  # per-worker models; None: the fixed ``cost`` for every worker

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ConfigError("block_tokens must be >= 1")
        if self.costs is None:
            self.costs = CostBook(self.cost, LearnSettings(enabled=False))


def build_params(params_cls: type | None, weights: Mapping[str, Any] | None, policy: str) -> Any:
    """A policy's parameter dataclass with ``weights`` overriding its defaults, validated."""
    weights = dict(weights or {})
    if params_cls is None:
        if weights:
            raise ConfigError(f"policy {policy!r} takes no weights, got {sorted(weights)}")
        return None
    known = {f.name: f for f in dataclasses.fields(params_cls)}
    unknown = sorted(set(weights) - set(known))
    if unknown:
        raise ConfigError(f"policy {policy!r}: unknown weights {unknown}; known: {sorted(known)}")
    defaults = params_cls()
    for k, v in weights.items():
        want_bool = isinstance(getattr(defaults, k), bool)
        if isinstance(v, bool) != want_bool or not isinstance(v, (int, float)):
            kind = "true/false" if want_bool else "a number"
            raise ConfigError(f"policy {policy!r}: weight {k!r} must be {kind}, got {v!r}")
    try:
        return params_cls(**weights)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"policy {policy!r}: {exc}") from exc


def tie_key(w: WorkerView) -> tuple[int, str]:
    """Among equal scores prefer the less loaded worker, then the smaller id (deterministic)."""
    return (w.inflight, w.id)


def cached_tokens(blocks: int, block_tokens: int, prompt_tokens: int) -> int:
    """Prompt tokens covered by ``blocks`` leading blocks (a trace's last block may be partial)."""
    t = blocks * block_tokens
    return t if t < prompt_tokens else prompt_tokens
