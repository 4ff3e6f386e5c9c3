"""Integrations of the pool's KV cache with model runtimes.

    cxlkv.integrations.transformers   Hugging Face transformers (DynamicCache) on torch
    cxlkv.integrations.vllm           a vLLM KV connector (KVConnectorBase_V1)

Each needs its runtime installed (`pip install cxlkv[transformers]`, or vLLM in
its own environment); importing this package needs neither.  Integrations use
only cxlkv's public API (cxlkv/__init__.py).
"""
