"""Prometheus metrics of a RemoteClient (prometheus-client): register
``Collector(client)`` in a serving process's registry, or
``cxlkv.kv.tiers.remote.collector(pool)`` for the pool's remote tier; the node
agent registers one for the client its write-behind uses."""
from __future__ import annotations

from cxlkv.util.stats import StatsCollector

#: counters of RemoteClient.stats() exported as cxlkv_remote_<name>_total
COUNTERS = (
    ("lookups", "lookups", "Read-through lookups sent to the remote tier."),
    ("hit_blocks", "hits", "Blocks the remote tier returned, verified."),
    ("miss_blocks", "misses", "Blocks looked up and not returned (absent, late, unreachable)."),
    ("hit_bytes", "hit_bytes", "Payload bytes the remote tier returned."),
    ("corrupt_blocks", "corrupt", "Damaged values found (misses, deleted)."),
    ("incompatible_blocks", "incompatible", "Values of a newer format or another block size "
                                            "(misses, kept)."),
    ("timeouts", "timeouts", "Lookups whose budget ran out before every answer arrived."),
    ("errors", "errors", "Operations the cluster failed."),
    ("skipped_lookups", "skipped", "Lookups answered as misses at once while the cluster was "
                                   "unreachable."),
    ("pushed_blocks", "pushed", "Blocks written to the cluster."),
    ("pushed_bytes", "pushed_bytes", "Payload bytes written to the cluster."),
    ("pushed_replicated_blocks", "pushed_replicated", "Written blocks confirmed on "
                                                       "wait_replicas replicas."),
    ("present_blocks", "present", "Pushed blocks the cluster already held."),
    ("promoted_blocks", "promoted", "Remote blocks stored into the pool (read-through)."),
    ("promote_failed", "promote_failed", "Read-through stores the pool refused (full, "
                                         "pinned, quota)."),
)
DROPS = ("queue-full", "unavailable", "over-budget", "closed")


GAUGES = (
    ("queue_bytes", "queued_bytes", "Value bytes waiting to be pushed."),
    ("queue_limit_bytes", "queue_bytes", "Bound of the push queue."),
    ("unavailable", lambda s: int(bool(s.get("unavailable"))),
     "1 while the cluster is treated as unreachable."),
    ("failing", lambda s: int(bool(s.get("failing"))),
     "1 from a failed or unanswered operation until one succeeds."),
    ("over_budget", lambda s: int(bool(s.get("over_budget"))),
     "1 while the cluster's used_memory is at max_bytes."),
    ("used_memory_bytes", "used_memory", "The cluster's used_memory, last polled (max_bytes set)."),
)


class Collector(StatsCollector):
    """`source`: a RemoteClient, or a callable returning one (or None)."""

    def __init__(self, source):
        super().__init__("cxlkv_remote", source, COUNTERS, GAUGES, [(
            "dropped_blocks", "Pushes dropped, by reason.", "reason",
            [(r, f"dropped_{r}") for r in DROPS])])
