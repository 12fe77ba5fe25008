"""The GPT2 shapes the benchmarks use, built with materialized random weights (no model hub)."""

from __future__ import annotations

import torch

# The shape of the released 124M GPT2 checkpoint.
GPT2_124M = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
# ppsplit's default tiny model (conf/model/gpt2.yaml).
GPT2_TINY = dict(n_layer=4, n_embd=64, n_head=4, vocab_size=1000, n_positions=128)

CALL_KWARGS = {"return_dict": False, "use_cache": False}


def gpt2(seed: int = 0, **shape) -> torch.nn.Module:
    """A GPT2LMHeadModel of ``shape`` in eval mode, weights drawn from ``seed``."""
    import transformers

    # Token ids inside a small vocabulary keep transformers from warning about the defaults.
    cfg = transformers.GPT2Config(use_cache=False, bos_token_id=0, eos_token_id=0, **shape)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg).eval()


def token_ids(model: torch.nn.Module, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen)
