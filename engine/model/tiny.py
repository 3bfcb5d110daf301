"""The embedded tiny checkpoints: deterministic, a few MB, made on first use.

``make_tiny(dir, model_type)`` writes a Hugging Face-format checkpoint (config.json +
model.safetensors with transformers' tensor names, and a tokenizer folder: a byte-level
``tokenizer.json`` with ids 0 <bos>, 1 <eos>, 2 <pad>, 3 + b for byte b, and a
``tokenizer_config.json`` that adds BOS and carries :data:`TINY_CHAT_TEMPLATE`). The default model, ``tiny``, is a
``glm_moe_dsa`` one with index sharing ("FSFS") and MoE layers; its ``index_topk`` (32) is far
below typical prompt lengths, so sparse selection really selects.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY_VERSION = 3  # part of the cache path: bump when the checkpoint's bytes change
MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
# One block per message, the generation prompt last; BOS first, as DeepSeek's template writes it.
TINY_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def tiny_config(model_type: str = "glm_moe_dsa", **overrides) -> dict:
    if model_type not in MODEL_TYPES:
        raise ValueError(f"--type: unknown model type {model_type!r}; expected one of {', '.join(MODEL_TYPES)}")
    cfg = {
        "architectures": [{"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM",
                           "glm_moe_dsa": "GlmMoeDsaForCausalLM"}[model_type]],
        "model_type": model_type,
        "vocab_size": 320,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "rope_interleave": True,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "initializer_range": 0.02,
        "dtype": "float32",
    }
    if model_type != "deepseek_v3":
        # 16 indexer heads, not fewer: the indexer scores are sums of ReLU-ed head scores, so with
        # few heads many tokens score exactly 0, and when the k-th score is such a tie the
        # selection is a tie-break (ours: lower position; transformers': whatever torch.topk
        # returns). With 4 heads that happened in ~5% of rows past 64 tokens and made the logits
        # differ from transformers'; with 16 a zero score is ~1e-5 likely per token.
        cfg.update({"index_topk": 32, "index_head_dim": 32, "index_n_heads": 16})
    if model_type == "glm_moe_dsa":
        cfg["indexer_types"] = ["full", "shared", "full", "shared"]
    if model_type != "deepseek_v3":
        n = cfg["num_hidden_layers"]
        cfg["mlp_layer_types"] = ["dense"] * cfg["first_k_dense_replace"] + ["sparse"] * (n - cfg["first_k_dense_replace"])
    cfg.update(overrides)
    if model_type == "glm_moe_dsa" and "num_hidden_layers" in overrides and "indexer_types" not in overrides:
        cfg["indexer_types"] = ["full" if i % 2 == 0 else "shared" for i in range(cfg["num_hidden_layers"])]
    if model_type != "deepseek_v3" and "num_hidden_layers" in overrides and "mlp_layer_types" not in overrides:
        n, k = cfg["num_hidden_layers"], min(cfg["first_k_dense_replace"], cfg["num_hidden_layers"])
        cfg["mlp_layer_types"] = ["dense"] * k + ["sparse"] * (n - k)
    return cfg


def tiny_weights(cfg_dict: dict, seed: int = 0, std: float = 0.08) -> dict[str, torch.Tensor]:
    """Deterministic random weights under transformers' tensor names (experts per expert)."""
    from engine.model.config import ModelConfig
    from engine.model.model import CausalLM

    cfg = ModelConfig.from_dict(cfg_dict)
    with torch.device("meta"):
        lm = CausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, meta in lm.state_dict().items():
        shape = tuple(meta.shape)
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            t = torch.randn(shape, generator=gen)
        else:
            t = std * torch.randn(shape, generator=gen)
        if name.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj")):
            prefix, proj = name.rsplit(".", 1)
            for e in range(shape[0]):
                out[f"{prefix}.{e}.{proj}.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    return out


def make_tiny(path: str | Path, model_type: str = "glm_moe_dsa", seed: int = 0, std: float = 0.08,
              **overrides) -> Path:
    """Write a deterministic tiny checkpoint to `path` (created atomically); ``std``: the
    projections' random scale."""
    path = Path(path)
    cfg = tiny_config(model_type, **overrides)
    weights = tiny_weights(cfg, seed=seed, std=std)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=path.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        from engine.model.tokenizer import byte_tokenizer_files

        for name, text in byte_tokenizer_files(cfg["vocab_size"], TINY_CHAT_TEMPLATE).items():
            (tmp / name).write_text(text)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def cache_dir() -> Path:
    base = os.environ.get("CPSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "cpserve")
    return Path(base)


# The trained demo model (scripts/train_demo.py), shipped in the package: `cpserve up`'s default.
DEMO_DIR = Path(__file__).resolve().parent / "demo"


def resolve_model_dir(model: str | Path) -> Path:
    """A checkpoint directory, the shipped ``demo`` model, or the embedded ``tiny`` (also
    ``tiny-v3``, ``tiny-v32``) model."""
    name = str(model)
    if name == "demo":
        return DEMO_DIR
    aliases = {"tiny": "glm_moe_dsa", "tiny-glm": "glm_moe_dsa", "tiny-v3": "deepseek_v3", "tiny-v32": "deepseek_v32"}
    if name in aliases:
        target = cache_dir() / "models" / f"tiny-{aliases[name]}-v{TINY_VERSION}"
        if not (target / "config.json").is_file():
            make_tiny(target, aliases[name])
        return target
    path = Path(name)
    if not path.is_dir():
        from engine.model.config import ModelConfigError

        raise ModelConfigError(f"model: {name!r} is neither a checkpoint directory nor 'demo' or 'tiny'")
    return path
