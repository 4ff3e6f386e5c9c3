"""Small models for the tests, the demos and the TTFT benches, built from a
config with a fixed seed (nothing is downloaded).  Needs torch and
transformers (pip install -e '.[transformers]')."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

#: the small Llama used by the demo, the tests and the TTFT bench
TINY_LLAMA = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384)


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **config):
    """A small Llama-architecture model with random weights drawn from `seed`
    (the same weights in every process): for demos and tests where no
    checkpoint can be downloaded.  config overrides TINY_LLAMA's fields."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **config}))
    finally:
        torch.random.set_rng_state(state)
    return model.to(dtype).eval()
