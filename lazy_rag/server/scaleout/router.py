"""``ChunkAffinityRouter``: Ray Serve's request-router extension point (a ``RequestRouter``
subclass, configured on the engine deployment through ``RequestRouterConfig``) running the
chunk-affinity policy of ``affinity.py``.

Every handle that calls the engine deployment (each ingress replica's) has its own router. It
reads the request's ``ChunkRoute`` (the first argument of ``EngineReplica.generate``), the
replicas' queue lengths from Serve's queue-length cache (requests sent and not finished, kept
up to date on every send and completion, probed when stale) and each replica's resident chunks
from its routing stats (``EngineReplica.record_routing_stats``, every
``request_routing_stats_period_s``), plus the chunks it sent since. It answers a ranking, one
replica per rank: Serve takes the first whose queue is below ``max_ongoing_requests`` and tries
the next otherwise, with its own backoff when all are full.

Ray's ``PrefixCacheAffinityRouter`` (ray.serve.llm) is the prefix-only analogue: it keeps a
prefix tree of prompt text per replica in a separate actor. Chunks need no tree (a chunk's KV is
reused at any position, so a set of chunk keys is the whole match), and the replicas themselves
say what their pools hold, so nothing is shared between routers but those reports.
"""
from __future__ import annotations

import logging
import random
from typing import List, Optional

from . import require_ray

require_ray()

from ray.serve.request_router import (PendingRequest, ReplicaID, ReplicaResult, RequestRouter,  # noqa: E402
                                      RunningReplica)

from .affinity import (RESIDENT_KEY, TAKEN_AT_KEY, VERSION_KEY, AffinitySettings, ChunkRoute,  # noqa: E402
                       RendezvousTable, ResidencyView, RoundRobin, rank_replicas)

log = logging.getLogger("lazy_rag.server.scaleout")


def route_of(pending_request: Optional[PendingRequest]) -> ChunkRoute | None:
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, ChunkRoute) else None


class ChunkAffinityRouter(RequestRouter):
    """Keyword arguments (``RequestRouterConfig.request_router_kwargs``): ``load_factor``,
    ``imbalance_threshold`` (``AffinitySettings``) and ``policy``: the deployment's default,
    "affinity", or "round_robin" / "least_loaded" as baselines (a request's ``ChunkRoute.policy``
    overrides it)."""

    def initialize_state(self, load_factor: float = AffinitySettings.load_factor,
                         imbalance_threshold: int = AffinitySettings.imbalance_threshold,
                         policy: str = "affinity"):
        self.settings = AffinitySettings(load_factor, imbalance_threshold)
        ChunkRoute(policy=policy)  # checks the name
        self.policy = policy
        self.table = RendezvousTable()
        self.residency = ResidencyView()
        self.round_robin = RoundRobin()

    def _queue_len(self, replica: RunningReplica) -> int:
        n = self.replica_queue_len_cache.get(replica.replica_id)
        return 0 if n is None else n  # unknown: Serve probes it when it picks that replica

    def _read_reports(self, replicas: List[RunningReplica]) -> None:
        for r in replicas:
            stats = r.routing_stats or {}
            if RESIDENT_KEY in stats:
                self.residency.report(r.replica_id.unique_id, stats[RESIDENT_KEY], stats.get(VERSION_KEY),
                                      stats.get(TAKEN_AT_KEY))

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        # a stable order: round robin and the rendezvous ranks index into it
        replicas = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        queue = [self._queue_len(r) for r in replicas]
        route = route_of(pending_request)
        # calls without chunks (info, stats) go round: each replica answers in turn
        policy = "round_robin" if route is None else route.policy or self.policy
        if policy == "round_robin":
            order = self.round_robin.rank(len(replicas))
        elif policy == "least_loaded":
            order = sorted(range(len(replicas)), key=lambda i: (queue[i], random.random()))
        else:
            self._read_reports(replicas)
            order = rank_replicas(route, [r.replica_id.unique_id for r in replicas], queue, self.residency,
                                  self.settings, self.table)
        return [[replicas[i]] for i in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        route = route_of(pending_request)
        if route is not None and route.keys:
            self.residency.sent(replica_id.unique_id, route.keys)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        # a dead replica's pool is gone; its replacement starts empty under a new id
        self.residency.keep_only({r.replica_id.unique_id for r in replicas})
