"""A real third-party model for the tests: Hugging Face `transformers` Llama from a tiny config,
random weights (nothing downloaded), trained on the shipped Shakespeare bytes. Named by import
strings: `hf_models:build_llama`, `hf_models:shakespeare_batch`."""

from __future__ import annotations

import torch

from precision_suite.training.data import BYTE_VOCAB, text_batch

SEQ_LEN = 32


def llama_config(attn_implementation: str = "sdpa"):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=BYTE_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=SEQ_LEN,
        attn_implementation=attn_implementation,
    )


def build_llama(spec=None):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config())


def shakespeare_batch(spec, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return text_batch(spec.batch_size or 4, SEQ_LEN, generator)
