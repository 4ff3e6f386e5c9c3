"""CXL poison records -> pool offsets.

Where poison records come from (what the lab captured, tests/fixtures/lab/poison/):

* the kernel's `cxl_poison` trace event (kernel 6.5+; tracefs
  events/cxl/cxl_poison), emitted for every record of a memdev's poison list
  when 1 is written to /sys/bus/cxl/devices/memX/trigger_poison_list
  (trace_type=List), for debugfs inject_poison / clear_poison (Inject /
  Clear), and for poison the device reports by itself;
* `cxl monitor` (ndctl), which prints each cxl trace event as one JSON object
  (flat: memdev, dpa, hpa, dpa_length as numbers, trace_type and source as
  codes; stop it with SIGINT, or its buffered output is lost);
* `cxl list --media-errors` (ndctl 80+) - not in Debian bookworm's ndctl 76.1,
  so not parsed here (nothing real to test it against).

The translation follows the region's decoders, as the kernel does
(drivers/cxl/core/region.c, cxl_dpa_to_hpa): a DPA is an offset into the
memdev's endpoint decoder's DPA range; with the region's interleave ways W,
granularity G and the memdev's position P in the region,

    dpa_offset = dpa - decoder.dpa_resource
    hpa_offset = ((dpa_offset // G) * W + P) * G + dpa_offset % G
    hpa        = region.resource + hpa_offset

(modulo interleave: HPA granule k belongs to position k mod W, which is the
check the kernel's cxl_is_hpa_in_range makes; for W = 3, 6, 12 the kernel's
multiply form is the same arithmetic).  The HPA then lies in a DAX device
(/sys/bus/dax/devices/daxX.Y/resource, size), whose offset 0 is offset 0 of
a cxlkv pool on /dev/daxX.Y.

Everything is read through cxlkv.host.sysfs (the one redirectable sysfs root),
so tests run on captured trees.  This module imports only errors and util.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cxlkv.errors import UsageError
from cxlkv.host import sysfs

log = logging.getLogger(__name__)

#: the `source` field of a cxl_poison event (CXL 3.0 8.2.9.8.4.1, kernel trace.h)
SOURCES = ("Unknown", "External", "Internal", "Injected", "Vendor", "Reserved")
#: trace_type of a cxl_poison event
TRACE_TYPES = ("List", "Inject", "Clear")
#: the interleave ways the CXL spec allows (HDM decoder IW encodings)
VALID_WAYS = (1, 2, 3, 4, 6, 8, 12, 16)
POISON_GRANULE = 64         # poison is tracked per 64-byte cache line


@dataclass
class PoisonRecord:
    """One poison record (a cxl_poison event, or a `cxl monitor` event of it)."""

    memdev: str
    dpa: int
    length: int
    region: str | None = None
    hpa: int | None = None          # the kernel's own translation, when it made one
    trace_type: str = "List"        # List | Inject | Clear
    source: str = "Unknown"
    flags: str = ""
    serial: int | None = None
    host: str | None = None
    timestamp: float | None = None  # trace clock seconds, when known
    origin: str = "trace"           # trace | monitor

    def to_json(self) -> dict:
        return asdict(self)


_TRACE_RE = re.compile(r"^\s*(?P<task>.+?)\s+\[(?P<cpu>\d+)\]\s+(?P<flags>\S+)\s+"
                       r"(?P<ts>\d+\.\d+):\s+cxl_poison:\s+(?P<body>.*)$")
_FIELD_RE = re.compile(r"(\w+)=(\S*)")


def _int(text: str | None) -> int | None:
    if text in (None, ""):
        return None
    try:
        return int(text, 0)
    except ValueError:
        return None


def _record(f: dict, *, origin: str, ts: float | None) -> PoisonRecord:
    dpa, length = _int(str(f.get("dpa", ""))), _int(str(f.get("dpa_length", "")))
    if not f.get("memdev") or dpa is None or length is None:
        raise UsageError(f"not a cxl_poison record (memdev, dpa and dpa_length needed): {f}")
    hpa = _int(str(f.get("hpa", "")))
    region = f.get("region") or None
    return PoisonRecord(
        memdev=str(f["memdev"]), dpa=dpa, length=length, region=region,
        # the kernel prints ULLONG_MAX as the hpa of a DPA it did not map
        hpa=None if hpa in (None, (1 << 64) - 1) or not region else hpa,
        trace_type=str(f.get("trace_type", "List")), source=str(f.get("source", "Unknown")),
        flags=str(f.get("flags", "")), serial=_int(str(f.get("serial", ""))),
        host=f.get("host") or None, timestamp=ts, origin=origin)


def parse_trace(text: str) -> list[PoisonRecord]:
    """The cxl_poison events in tracefs `trace` / `trace_pipe` text, in order.
    Other events and comment lines are ignored; a cxl_poison line that lacks
    memdev, dpa or dpa_length raises UsageError (it is not one we understand)."""
    out = []
    for line in text.splitlines():
        if "cxl_poison:" not in line or line.lstrip().startswith("#"):
            continue
        m = _TRACE_RE.match(line)
        body = m.group("body") if m else line.split("cxl_poison:", 1)[1]
        f = dict(_FIELD_RE.findall(body))
        out.append(_record(f, origin="trace", ts=float(m.group("ts")) if m else None))
    return out


def parse_monitor(text: str) -> list[PoisonRecord]:
    """The cxl_poison events among `cxl monitor` output (one JSON object per
    event; other events are ignored).  Bad JSON raises UsageError naming the line."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            ev = json.loads(line)
        except ValueError as e:
            raise UsageError(f"cxl monitor output line {n} is not JSON: {e}") from None
        if not isinstance(ev, dict) or ev.get("event") != "cxl_poison":
            continue
        # ndctl 76.1 prints the event's fields at the top level, numbers as
        # numbers (trace_type 0 List, 1 Inject, 2 Clear; source as in SOURCES)
        data = {**ev, **(ev.get("data") or {})}
        for key, names in (("trace_type", _TRACE_TYPE_CODES), ("source", _SOURCE_CODES)):
            if isinstance(data.get(key), int):
                data[key] = names.get(data[key], "Reserved")
        ts = ev.get("timestamp")
        out.append(_record(data, origin="monitor",
                           ts=ts / 1e9 if isinstance(ts, (int, float)) else None))
    return out


_TRACE_TYPE_CODES = {0: "List", 1: "Inject", 2: "Clear"}
_SOURCE_CODES = {0: "Unknown", 1: "External", 2: "Internal", 3: "Injected", 7: "Vendor"}


def current_poison(records: list[PoisonRecord]) -> list[PoisonRecord]:
    """Records still poisoned: the latest List/Inject per (memdev, dpa) not
    followed by a Clear of it.  A List after a Clear brings it back."""
    state: dict[tuple[str, int], PoisonRecord | None] = {}
    for r in records:
        key = (r.memdev, r.dpa)
        state[key] = None if r.trace_type == "Clear" else r
    return [r for r in state.values() if r is not None]


# -- interleave arithmetic ---------------------------------------------------------------

def check_interleave(ways: int, granularity: int) -> None:
    if ways not in VALID_WAYS:
        raise UsageError(f"interleave ways {ways} is not one CXL allows {VALID_WAYS}")
    if granularity < 256 or granularity > 16384 or granularity & (granularity - 1):
        raise UsageError(f"interleave granularity {granularity} is not a power of two "
                         "from 256 to 16384")


def dpa_offset_to_hpa_offset(dpa_offset: int, ways: int, granularity: int, pos: int) -> int:
    """Offset into the region's HPA range of offset `dpa_offset` into the
    endpoint decoder's DPA range, for the memdev at position `pos`."""
    check_interleave(ways, granularity)
    if not 0 <= pos < ways:
        raise UsageError(f"position {pos} outside an interleave of {ways}")
    granule, within = divmod(dpa_offset, granularity)
    return (granule * ways + pos) * granularity + within


def hpa_offset_to_dpa_offset(hpa_offset: int, ways: int, granularity: int) -> tuple[int, int]:
    """The inverse: (position, dpa offset) of an HPA offset into the region."""
    check_interleave(ways, granularity)
    granule, within = divmod(hpa_offset, granularity)
    row, pos = divmod(granule, ways)
    return pos, row * granularity + within


# -- sysfs: regions, decoders, DAX devices ---------------------------------------------

@dataclass
class Target:
    position: int
    decoder: str
    memdev: str | None
    dpa_resource: int
    dpa_size: int


@dataclass
class RegionMap:
    """What DPA -> HPA needs of one CXL region (sysfs)."""

    region: str
    resource: int
    size: int
    ways: int
    granularity: int
    targets: list[Target] = field(default_factory=list)

    def target_of(self, memdev: str) -> Target:
        for t in self.targets:
            if t.memdev == memdev:
                return t
        raise UsageError(f"{memdev} is not a target of {self.region} "
                         f"(targets: {', '.join(str(t.memdev) for t in self.targets)})")

    def dpa_to_hpa(self, memdev: str, dpa: int) -> int | None:
        """HPA of a memdev's DPA, or None when the DPA is outside the part of
        the memdev this region maps."""
        t = self.target_of(memdev)
        if not t.dpa_resource <= dpa < t.dpa_resource + t.dpa_size:
            return None
        hpa_off = dpa_offset_to_hpa_offset(dpa - t.dpa_resource, self.ways, self.granularity,
                                           t.position)
        if hpa_off >= self.size:
            return None
        return self.resource + hpa_off


def _decoder_dir(name: str) -> Path:
    return sysfs.sys_path("bus", "cxl", "devices", name)


def _need_int(path: Path) -> int:
    v = sysfs.read_int(path)
    if v is None:
        raise UsageError(f"cannot read {path} (no such attribute, or not a number)")
    return v


def region_map(region: str) -> RegionMap:
    """A CXL region's decode parameters from sysfs (regionN and the endpoint
    decoders its targetK attributes name)."""
    d = sysfs.sys_path("bus", "cxl", "devices", region)
    if not d.exists():
        raise UsageError(f"no CXL region {region} ({d} does not exist)")
    ways = _need_int(d / "interleave_ways")
    rm = RegionMap(region=region, resource=_need_int(d / "resource"), size=_need_int(d / "size"),
                   ways=ways, granularity=_need_int(d / "interleave_granularity"))
    for pos in range(ways):
        dec = sysfs.read_attr(d / f"target{pos}")
        if not dec:
            raise UsageError(f"{region}: target{pos} is empty (region not committed?)")
        dd = _decoder_dir(dec)
        # the endpoint port's uport link names the memdev (endpointN/uport -> .../memX)
        memdev = sysfs.read_attr(dd / "memdev") or _uport_memdev(dd)
        rm.targets.append(Target(position=pos, decoder=dec, memdev=memdev,
                                 dpa_resource=_need_int(dd / "dpa_resource"),
                                 dpa_size=_need_int(dd / "dpa_size")))
    return rm


def _uport_memdev(decoder_dir: Path) -> str | None:
    try:
        real = decoder_dir.resolve()
        target = (real.parent / "uport").readlink()
    except OSError:
        return None
    return target.name if target.name.startswith("mem") else None


def regions() -> list[str]:
    d = sysfs.sys_path("bus", "cxl", "devices")
    try:
        names = sorted(p.name for p in d.iterdir())
    except OSError:
        return []
    return [n for n in names if re.fullmatch(r"region\d+", n)]


@dataclass
class DaxRange:
    dax: str
    resource: int
    size: int


def dax_ranges() -> list[DaxRange]:
    """Every DAX device's physical range (/sys/bus/dax/devices/daxX.Y)."""
    d = sysfs.sys_path("bus", "dax", "devices")
    out = []
    try:
        names = sorted(p.name for p in d.iterdir())
    except OSError:
        return out
    for n in names:
        res = sysfs.read_int(d / n / "resource")
        size = sysfs.read_int(d / n / "size")
        if res is not None and size:
            out.append(DaxRange(n, res, size))
    return out


@dataclass
class Translation:
    """A poison record placed: DPA -> HPA -> DAX device offset -> pool offset."""

    record: PoisonRecord
    region: str | None
    hpa: int | None
    dax: str | None
    dax_offset: int | None
    pool_offset: int | None
    length: int
    note: str = ""

    def to_json(self) -> dict:
        d = asdict(self)
        d["record"] = self.record.to_json()
        return d


class Translator:
    """Translate poison records with the decoders and DAX devices in sysfs
    (read once; make a new Translator after a region or namespace changes).

    pool_dax: the pool's DAX device name (e.g. "dax0.0") - records landing
    elsewhere get pool_offset None; pool_base: the pool's offset in it (0)."""

    def __init__(self, pool_dax: str | None = None, pool_base: int = 0,
                 pool_size: int | None = None):
        self.pool_dax, self.pool_base, self.pool_size = pool_dax, pool_base, pool_size
        self.maps: dict[str, RegionMap] = {}
        for r in regions():
            try:
                self.maps[r] = region_map(r)
            except UsageError as e:
                log.info("poison: region %s not usable for translation: %s", r, e)
        self.dax = dax_ranges()

    def _region_for(self, rec: PoisonRecord) -> RegionMap | None:
        if rec.region and rec.region in self.maps:
            return self.maps[rec.region]
        for rm in self.maps.values():
            if any(t.memdev == rec.memdev for t in rm.targets) and \
                    rm.dpa_to_hpa(rec.memdev, rec.dpa) is not None:
                return rm
        return None

    def translate(self, rec: PoisonRecord) -> Translation:
        rm = self._region_for(rec)
        if rm is None:
            return Translation(rec, None, None, None, None, None, rec.length,
                               "DPA not mapped by any CXL region")
        hpa = rm.dpa_to_hpa(rec.memdev, rec.dpa)
        if hpa is None:
            return Translation(rec, rm.region, None, None, None, None, rec.length,
                               f"DPA outside {rm.region}'s part of {rec.memdev}")
        note = ""
        if rec.hpa is not None and rec.hpa != hpa:
            note = f"kernel says hpa {rec.hpa:#x}, decoders say {hpa:#x}"
            log.warning("poison %s dpa %#x: %s", rec.memdev, rec.dpa, note)
        # a poisoned range longer than the granularity spans interleave
        # granules of other memdevs in HPA space: only its first granule's
        # bytes are contiguous here, and each granule is its own record
        length = min(rec.length, rm.granularity - (rec.dpa - rm.target_of(rec.memdev)
                                                   .dpa_resource) % rm.granularity) \
            if rm.ways > 1 else rec.length
        for dx in self.dax:
            if dx.resource <= hpa < dx.resource + dx.size:
                off = hpa - dx.resource
                pool_off = None
                if self.pool_dax in (None, dx.dax) and off >= self.pool_base:
                    pool_off = off - self.pool_base
                    if self.pool_size is not None and pool_off >= self.pool_size:
                        pool_off = None
                return Translation(rec, rm.region, hpa, dx.dax, off, pool_off,
                                   min(length, dx.resource + dx.size - hpa), note)
        return Translation(rec, rm.region, hpa, None, None, None, length,
                           note or "HPA in no DAX device (namespace metadata, or no namespace)")

    def ranges(self, records: list[PoisonRecord]) -> list[Translation]:
        """Translations of a record list, each interleaved record split per
        granule so every piece is contiguous in the pool."""
        out = []
        for rec in records:
            rm = self._region_for(rec)
            if rm is None or rm.ways == 1 or rec.length <= 0:
                out.append(self.translate(rec))
                continue
            start, end = rec.dpa, rec.dpa + rec.length
            while start < end:
                piece = PoisonRecord(**{**rec.to_json(), "dpa": start, "hpa": None})
                step = rm.granularity - (start - rm.target_of(rec.memdev).dpa_resource) \
                    % rm.granularity
                piece.length = min(step, end - start)
                out.append(self.translate(piece))
                start += piece.length
        return out


# -- live sources (the paths; the reading goes through the tool seam / files) ------------

def tracefs_root() -> Path:
    """Where tracefs is: /sys/kernel/tracing under the sysfs root."""
    return sysfs.sys_path("kernel", "tracing")


def poison_event_dir() -> Path:
    return tracefs_root() / "events" / "cxl" / "cxl_poison"


def trigger_path(memdev: str) -> Path:
    return sysfs.sys_path("bus", "cxl", "devices", memdev, "trigger_poison_list")


def supported() -> dict:
    """What this kernel offers for poison: {"trace_event", "trigger": [memdevs]}."""
    mems = []
    d = sysfs.sys_path("bus", "cxl", "devices")
    try:
        mems = sorted(p.name for p in d.iterdir() if re.fullmatch(r"mem\d+", p.name))
    except OSError:
        pass
    return {"trace_event": poison_event_dir().exists(),
            "trigger": [m for m in mems if trigger_path(m).exists()]}


def trigger_lists(memdevs: list[str]) -> list[str]:
    """Ask the kernel to read each memdev's poison list (its records arrive as
    cxl_poison trace_type=List events).  Returns the memdevs that failed,
    with why, as text lines."""
    bad = []
    for m in memdevs:
        p = trigger_path(m)
        try:
            p.write_text("1\n")
        except OSError as e:
            bad.append(f"{m}: {p}: {e.strerror or e}")
    return bad


def enable_trace_event() -> str | None:
    """Enable the cxl_poison trace event; None, or why it could not be."""
    p = poison_event_dir() / "enable"
    try:
        p.write_text("1\n")
    except OSError as e:
        return f"{p}: {e.strerror or e}"
    return None


def read_trace() -> str:
    """The tracefs ring buffer as text (`trace`: reading does not consume it)."""
    p = tracefs_root() / "trace"
    try:
        return p.read_text(errors="replace")
    except OSError as e:
        raise UsageError(f"cannot read {p}: {e.strerror or e} (tracefs mounted? root?)") \
            from None


class Follower:
    """New poison records from the cxl_poison trace event, poll by poll.

    start(): enable the event and trigger the poison list of `memdevs` (its
    records come back as trace_type=List).  poll(): the records not returned
    before (by timestamp, memdev, DPA, type), Clear records included.  The
    trace buffer is read, not consumed, so other readers (cxl monitor) still
    see every event."""

    def __init__(self, memdevs: list[str]):
        self.memdevs = list(memdevs)
        self.seen: set[tuple] = set()
        self.problems: list[str] = []

    def start(self) -> list[str]:
        why = enable_trace_event()
        self.problems = ([why] if why else []) + trigger_lists(self.memdevs)
        for p in self.problems:
            log.warning("poison: %s", p)
        return self.problems

    def poll(self) -> list[PoisonRecord]:
        out = []
        for r in parse_trace(read_trace()):
            key = (r.timestamp, r.memdev, r.dpa, r.length, r.trace_type)
            if key in self.seen:
                continue
            self.seen.add(key)
            out.append(r)
        return out
