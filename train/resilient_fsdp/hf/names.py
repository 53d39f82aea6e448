"""The built-in model's parameter names under transformers' ``LlamaForCausalLM`` names.

The built-in transformer is Llama's architecture (pre-norm RMSNorm, rotary embeddings on
half-split dimensions, grouped-query attention, SwiGLU, untied output), so its weights are a
Llama model's under other names. Only the names differ; no tensor is transposed or permuted.
"""

from __future__ import annotations

import re
from typing import Optional

from ..train.presets import ModelArgs

_BLOCK = {
    "attention_norm": "input_layernorm",
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAME = re.compile(r"^layers\.(\d+)\.(.+)\.weight$")
_HF_BLOCK_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")


def to_hf(name: str) -> str:
    """The ``LlamaForCausalLM`` name of the built-in parameter ``name`` (``layers.3.attention.wq.weight``
    -> ``model.layers.3.self_attn.q_proj.weight``); KeyError for a name the built-in model lacks."""
    if name in _TOP:
        return _TOP[name]
    m = _BLOCK_NAME.match(name)
    if not m or m.group(2) not in _BLOCK:
        raise KeyError(name)
    return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.weight"


def from_hf(name: str) -> str:
    """Inverse of :func:`to_hf`."""
    for ours, theirs in _TOP.items():
        if theirs == name:
            return ours
    m = _HF_BLOCK_NAME.match(name)
    inverse = {v: k for k, v in _BLOCK.items()}
    if not m or m.group(2) not in inverse:
        raise KeyError(name)
    return f"layers.{m.group(1)}.{inverse[m.group(2)]}.weight"


def llama_config(
    args: ModelArgs, max_positions: int, eos_token_id: Optional[int] = None, bos_token_id: Optional[int] = None
) -> dict:
    """The ``config.json`` of a preset as a ``LlamaForCausalLM``. Rotary embeddings work at any
    length; ``max_positions`` is what the model was trained on. ``rope_theta`` is given in both the
    older top-level key and ``rope_parameters``, so transformers 4.x and 5.x read the same model."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.dim // args.n_heads,
        "vocab_size": args.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "max_position_embeddings": max_positions,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }
