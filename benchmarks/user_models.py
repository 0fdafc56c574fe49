"""The user models `benchmarks/user_cost.py` times, named by import strings in its cases
(``user_models:llama_fp8``, ``user_models:llama_batch``): a Hugging Face Llama from a config
(random weights, nothing downloaded) whose projections torchao converts to float8 training
(tensorwise scales), as a team would wire its own model. Nothing from precision_suite.

Sizes (``SIZES``, chosen by the case's ``width``): 512 is the 17.3M-parameter model of issue 39
(4 layers, 8 heads, vocabulary 512, intermediate 1376), 1024 a 101M-parameter one (8 layers,
16 heads, intermediate 2752), 256 a 2M-parameter one for quick checks, 64 a 0.1M-parameter one for
the GPU check's --tiny (a CPU whose oneDNN takes its reference kernel for float8 GEMMs, as an AMX
Xeon's does, needs 0.6 s for one 256-wide `torch._scaled_mm`).
"""

from __future__ import annotations

import torch

SEQ_LEN = 128
VOCAB = 512
# width -> (layers, heads, intermediate)
SIZES = {64: (1, 2, 172), 256: (2, 4, 688), 512: (4, 8, 1376), 1024: (8, 16, 2752)}


def llama_config(width: int = 512):
    from transformers import LlamaConfig

    layers, heads, intermediate = SIZES[width]
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=SEQ_LEN,
        attn_implementation="sdpa",
    )


def llama_fp8(spec=None) -> torch.nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config(getattr(spec, "width", None) or 512))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    return model


def llama_batch(spec, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token prediction on random token sequences (the cost does not depend on the text)."""
    tokens = torch.randint(VOCAB, (spec.batch_size or 4, SEQ_LEN + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]
