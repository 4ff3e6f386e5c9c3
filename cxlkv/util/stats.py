"""A Prometheus collector over any object's stats() dict (the tiers' and the
remote client's counters), so that they export metrics without knowing who
serves them."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class StatsCollector:
    """A prometheus_client collector over an object's stats() dict, read at
    each scrape (the spill store, the remote client, the hot tier).

    source: the object, or a callable returning it (None: no samples).
    counters / gauges: (metric name, stats key or a function of the dict,
    help); labelled: (metric name, help, label, [(label value, key), ...]),
    exported as counters.  Names get `prefix`_ in front."""

    def __init__(self, prefix: str, source, counters=(), gauges=(), labelled=()):
        self.prefix = prefix
        self._source = source if callable(source) else (lambda: source)
        self.counters, self.gauges, self.labelled = counters, gauges, labelled

    def describe(self):
        return []

    def collect(self):
        obj = self._source()
        if obj is None:
            return
        s = obj.stats()

        def get(key):
            return key(s) if callable(key) else s.get(key) or 0

        for name, key, help_ in self.counters:
            yield CounterMetricFamily(f"{self.prefix}_{name}", help_, value=get(key))
        for name, help_, label, pairs in self.labelled:
            fam = CounterMetricFamily(f"{self.prefix}_{name}", help_, labels=[label])
            for value, key in pairs:
                fam.add_metric([value], get(key))
            yield fam
        for name, key, help_ in self.gauges:
            yield GaugeMetricFamily(f"{self.prefix}_{name}", help_, value=get(key))
