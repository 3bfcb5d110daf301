"""Tiny random checkpoints built with transformers itself (save_pretrained), for ground truth."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=2, topk_group=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16,
    v_head_dim=24, first_k_dense_replace=1, initializer_range=0.1, max_position_embeddings=4096,
    bos_token_id=0, eos_token_id=1, pad_token_id=2,
)
DSA = dict(index_topk=16, index_head_dim=32, index_n_heads=8)


def build_hf(model_type: str, path: Path, seed: int = 0, **overrides):
    """Save a random transformers model of `model_type`; returns the in-memory HF model (fp32, eval)."""
    import transformers

    kw = dict(COMMON)
    if model_type == "deepseek_v3":
        cls_cfg, cls_lm = transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM
    elif model_type == "deepseek_v32":
        cls_cfg, cls_lm = transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM
        kw.update(DSA)
    else:
        cls_cfg, cls_lm = transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM
        kw.update(DSA, index_topk_pattern="FFSF")
    kw.update(overrides)
    torch.manual_seed(seed)
    cfg = cls_cfg(**kw)
    model = cls_lm(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.05 * torch.randn_like(p))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "weights_proj" in name:
                # Positive head weights keep exact-zero index scores at the bottom of the ranking.
                p.abs_()
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(path)
    return model
