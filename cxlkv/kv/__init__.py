"""The KV cache on the pool: keys, the KV region, the API, its checks, the
change journal, snapshots, and the tiers beside the pool (cxlkv.kv.tiers)."""
import importlib
import warnings

#: the tiers' modules moved to cxlkv.kv.tiers; their old names still import
_MOVED = {"spill": "cxlkv.kv.tiers.spill", "hot": "cxlkv.kv.tiers.hot",
          "remote": "cxlkv.kv.tiers.remote"}


def __getattr__(name):
    # `from cxlkv.kv import spill` (the name before the tiers moved): loaded
    # on first use, as a tier's module is, with a DeprecationWarning
    if name in _MOVED:
        warnings.warn(f"cxlkv.kv.{name} moved to {_MOVED[name]}", DeprecationWarning,
                      stacklevel=2)
        return importlib.import_module(_MOVED[name])
    raise AttributeError(f"module 'cxlkv.kv' has no attribute {name!r}")
