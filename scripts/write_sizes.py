"""How the size of one buffered write call meets the kernel's dirty-page throttling.

    python scripts/write_sizes.py [--dir DIR] [--sizes 256,512,1024] [--threads 1,2]
                                  [--idle 10] [--mib 1024]

For each write size (KiB) and writer-thread count: wait --idle seconds with
no writes (the disk's writeback state settles, as between two bursts of
spill), then write --mib MiB of a fresh sparse file of DIR from long-lived
threads with pwritev calls of that size (256 KiB buffers, as the spill
writers' slots), and print the milliseconds each 32 MiB took and the
kernel's Dirty MiB at the end.  A chunk taking ten times the others is the
writers being paused by balance_dirty_pages.  On Linux 6.18 / ext4 here
(2026-12-07), bursts of 1 MiB calls from one or two threads were paused
from 160-320 MiB dirty on, at 70-90 ms per 32 MiB (about 0.4 GiB/s), in 5
of 11 bursts of 256 MiB and in both of 1 GiB; calls of 256 or 512 KiB in
none of 13 and 4: why the spill store's WRITE_BYTES is 512 KiB.
"""
import argparse
import os
import queue
import tempfile
import threading
import time

CHUNK = 32 << 20
BUF = 256 << 10


def dirty_mib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Dirty:"):
                return int(line.split()[1]) >> 10
    return -1


def burst(d: str, size: int, threads: int, total: int) -> list:
    """(ms, dirty MiB) per 32 MiB chunk of `total` bytes written in `size`-byte calls."""
    buf = os.urandom(BUF)
    per = size // BUF
    fd, path = tempfile.mkstemp(dir=d, prefix="write-sizes-")
    q: queue.Queue = queue.Queue()
    errors = []

    def writer():
        while (off := q.get()) is not None:
            try:
                n = os.pwritev(fd, [buf] * per, off)
                if n != size:
                    raise OSError(f"short write: {n} of {size} bytes")
            except OSError as e:
                errors.append(e)
            finally:
                q.task_done()
        q.task_done()

    ths = [threading.Thread(target=writer, daemon=True) for _ in range(threads)]
    for t in ths:
        t.start()
    out = []
    try:
        os.ftruncate(fd, total)
        for c in range(0, total, CHUNK):
            t0 = time.perf_counter()
            for off in range(c, min(total, c + CHUNK), size):
                q.put(off)
            q.join()
            out.append((round((time.perf_counter() - t0) * 1e3, 1), dirty_mib()))
    finally:
        for _ in ths:
            q.put(None)
        for t in ths:
            t.join()
        os.close(fd)
        os.unlink(path)
    if errors:
        raise errors[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="where to write (the spill store's disk)")
    ap.add_argument("--sizes", default="256,512,1024", help="write sizes in KiB, comma-separated")
    ap.add_argument("--threads", default="1,2", help="writer-thread counts, comma-separated")
    ap.add_argument("--idle", type=float, default=10.0, help="seconds without writes first")
    ap.add_argument("--mib", type=int, default=1024, help="MiB written per burst")
    a = ap.parse_args()
    sizes = [int(s) << 10 for s in a.sizes.split(",")]
    if any(s < BUF or s % BUF for s in sizes):
        ap.error("--sizes: multiples of 256 KiB")
    for size in sizes:
        for threads in (int(t) for t in a.threads.split(",")):
            time.sleep(a.idle)
            res = burst(a.dir, size, threads, a.mib << 20)
            chunks = " ".join(f"{ms:g}" for ms, _ in res)
            print(f"{size >> 10:5d} KiB x {threads} threads: ms per 32 MiB {chunks}; "
                  f"dirty {res[-1][1]} MiB at the end", flush=True)


if __name__ == "__main__":
    main()
