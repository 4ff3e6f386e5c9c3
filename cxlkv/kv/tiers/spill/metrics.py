"""The spill store's Prometheus metrics (cxlkv_spill_*), over its stats()."""
from __future__ import annotations

from cxlkv.kv.tiers.spill.store import DROP_REASONS
from cxlkv.util.stats import StatsCollector

#: cxlkv_spill_* counters: (name, stats key, help)
METRIC_COUNTERS = (
    ("written_blocks", "written", "Blocks this process wrote to the spill store."),
    ("written_bytes", "written_bytes", "Payload bytes this process wrote to the spill store."),
    ("hits", "hits", "Spilled blocks this process read back and verified."),
    ("queued_hits", "queued_hits",
     "Of the hits, blocks read from the writer queue before they reached the disk."),
    ("misses", "misses", "Spilled blocks looked for and not found."),
    ("promoted_blocks", "promoted", "Spilled blocks stored back into the pool."),
    ("promote_failed", "promote_failed", "Promotions the pool refused (pinned full, quota)."),
    ("corrupt", "corrupt", "Spilled files that failed verification (removed)."),
    ("evicted_blocks", "evicted", "Files the owner removed to make room (its LRU)."),
    ("second_chances", "second_chance", "LRU victims kept because a reader used them since."),
    ("already_on_disk", "already", "Evicted blocks already on disk (not written again)."),
)
METRIC_GAUGES = (
    ("store_bytes", "used_bytes", "File bytes in the spill store (all processes)."),
    ("limit_bytes", "max_bytes", "The spill store's size limit (the owner's)."),
    ("queue_bytes", "queued_bytes", "Payload bytes waiting for this process's spill writers."),
    ("queue_limit_bytes", "queue_bytes", "Bound of the spill writer queue."),
    ("blocks", "blocks", "Files indexed by this process (the owner: all it knows of)."),
    ("owner", lambda s: 1 if s["mode"] == "owner" else 0,
     "1 when this process owns the spill directory, 0 a reader."),
)


class Collector(StatsCollector):
    """A prometheus_client collector over a spill store's stats(): register
    it in a serving process's registry (``spill.collector(pool)``); the node
    agent registers one for the store it owns.  `source` is a SpillStore, or
    a callable returning one (or None: no samples)."""

    def __init__(self, source):
        super().__init__("cxlkv_spill", source, METRIC_COUNTERS, METRIC_GAUGES, [(
            "dropped_blocks", "Evicted blocks not spilled, by reason (queue-full, store-full, "
            "disk, copy, gone).", "reason", [(r, f"dropped_{r}") for r in DROP_REASONS])])
