"""The remote tier: KV blocks shared across racks through an existing Redis
Cluster or Valkey cluster (never a store of cxlkv's own).

    from cxlkv.remote import RemoteClient, RemoteConfig
    rc = RemoteClient(RemoteConfig.from_toml("/etc/cxlkv/kv0.toml"))

Modules: `value` (the value format), `config` (RemoteConfig), `base` (the
RemoteTier interface), `tier` (the synchronous RemoteClient),
`redis_cluster` (RemoteTier on redis-py's asyncio cluster client),
`status` (what `cxlkv remote status` reports).  A real cluster on
loopback for tests and benches is `cxlkv.testing.redis.TestCluster`.
"""
from cxlkv.errors import CorruptValue, RemoteError, RemoteUnavailable
from cxlkv.remote.config import RemoteConfig
from cxlkv.remote.tier import Batch, RemoteClient, RemoteTier, key_name, ns_hash_name

__all__ = ["RemoteConfig", "RemoteClient", "RemoteTier", "RemoteError", "RemoteUnavailable",
           "Batch", "CorruptValue", "key_name", "ns_hash_name"]
