"""Helpers shared by the tests, the benches and the demos (never by the library).

`testing` may import any part of cxlkv; nothing in the library imports it.
Each module stands alone and this package imports none of them, so a test
pays only for what it uses (`models` needs torch and transformers, `redis`
the redis-server package) and `python -m cxlkv.testing.nodes` starts fast.

    redis     TestCluster: a real Redis Cluster of redis-server processes on
              loopback ports (masters, replicas, TLS, kill and failover)
    replay    ReplayRunner: the tool seam answered with what cxl/ndctl/daxctl/
              numactl printed in a real QEMU guest (tests/fixtures/lab)
    models    tiny_llama: a small Llama with random weights from a seed
    nodes     NodeProc: a separate process attached as its own node, driven
              over a pipe (JSON lines); the lock-manager process; helpers that
              run several nodes at once
    pools     the small test geometry, the data region's first word, and the
              pool-damaging helpers (raw byte patches, superblocks re-encoded,
              node slots written, chunk descriptors located)
    data      block contents a reader can check against their keys
    checks    assertions the tests share: fsck finds a pool clean, a condition
              holds within a deadline, fsck's JSON through the CLI
"""
