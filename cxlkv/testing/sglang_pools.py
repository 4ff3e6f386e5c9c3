"""SGLang's own host memory pools on the CPU, for the sglang tests and bench.

Importable only under the SGLang venv (`scripts/setup --engines`).
"""
from __future__ import annotations


def cpu_host_pool(kind: str, layout: str, *, pages: int, page: int, layers: int,
                  heads: int = 0, head_dim: int = 0, kv_lora_rank: int = 0, rope_dim: int = 0,
                  device_tokens: int | None = None):
    """SGLang's host pool (MHATokenToKVPoolHost for kind "mha",
    MLATokenToKVPoolHost for "mla") of `pages` pages of `page` tokens in
    `layout`, over SGLang's own device pool of `device_tokens` (default: as
    many as the host pool) on "cpu", bf16, built with the arguments SGLang's
    build_kv_host_pool passes but pin_memory=False (its default registers
    the buffer with CUDA).  SGLang 0.5.23's MHA page_head and MLA
    page_first_direct pools need pages >= layers."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    tokens = pages * page
    dev_tokens = tokens if device_tokens is None else device_tokens
    if kind == "mha":
        dev = MHATokenToKVPool(dev_tokens, page, torch.bfloat16, heads, head_dim, layers, "cpu",
                               False, start_layer=0, end_layer=layers)
        return MHATokenToKVPoolHost(
            dev.get_device_pool_infos()[0].buffer_info, 1.0, 0, page, layout,
            pin_memory=False, device_capacity_tokens=dev.size, start_layer=dev.start_layer,
            end_layer=dev.end_layer, write_back_staging=dev.hicache_write_back_staging,
            host_token_capacity=tokens)
    if kind != "mla":
        raise ValueError(f"host pool kind {kind!r}: mha or mla")
    dev = MLATokenToKVPool(dev_tokens, page, torch.bfloat16, kv_lora_rank, rope_dim, layers,
                           "cpu", False, start_layer=0, end_layer=layers)
    return MLATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, 1.0, 0, page, layout, pin_memory=False,
        override_kv_cache_dim=dev.kv_cache_dim, device_capacity_tokens=dev.size,
        start_layer=dev.start_layer, end_layer=dev.end_layer, target_layer_num=dev.layer_num,
        layer_shard_enabled=dev.layer_shard_enabled, host_token_capacity=tokens)
