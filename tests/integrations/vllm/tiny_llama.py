"""A tiny Llama with seeded random weights, written as config.json + safetensors: outputs
depend on every KV cache byte (unlike ``load_format="dummy"``), and no hub is needed."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_tiny_llama(path: Path, seed: int = 1234) -> Path:
    """Write the model into ``path`` (created) and return it."""
    path.mkdir(parents=True, exist_ok=True)
    c = CONFIG
    h, inter, kvh = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"]
    hd = c["head_dim"]
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=None):
        scale = scale if scale is not None else shape[-1] ** -0.5 * 2.0
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": w(c["vocab_size"], h, scale=1.0),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
               "lm_head.weight": w(c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(c["num_attention_heads"] * hd, h),
            p + "self_attn.k_proj.weight": w(kvh * hd, h),
            p + "self_attn.v_proj.weight": w(kvh * hd, h),
            p + "self_attn.o_proj.weight": w(h, c["num_attention_heads"] * hd),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        })
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(CONFIG, indent=1))
    return path
