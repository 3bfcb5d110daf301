"""Load a checkpoint (config.json + safetensors, single file or sharded) into :class:`CausalLM`.

Tensor names are the ones transformers writes. Routed experts may come per expert
(``mlp.experts.{e}.gate_proj.weight`` …, as DeepSeek and transformers' ``save_pretrained``
write them) or fused (``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``); both are
stacked into our ``[E, …]`` parameters. A missing, unexpected or mis-shaped tensor is a
:class:`CheckpointError` that names it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model.config import ModelConfig
from engine.model.model import CausalLM

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


class CheckpointError(ValueError):
    """The checkpoint does not fit the model; the message names the tensor."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype: {name!r} is not supported; use one of fp32, bf16")
    return _DTYPES[name]


def _shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"checkpoint: shard {f.name} listed in {index.name} is missing")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint: no safetensors files in {path}")
    return files


def _ignored(name: str, cfg: ModelConfig) -> bool:
    """Tensors we knowingly skip: multi-token-prediction layers past the last layer, rotary buffers."""
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return bool(m and int(m.group(1)) >= cfg.num_layers) or name.endswith("rotary_emb.inv_freq")


def read_state_dict(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """All tensors, with per-expert weights stacked into our parameter names."""
    tensors: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for f in _shard_files(path):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                if _ignored(name, cfg):
                    continue
                t = fh.get_tensor(name)
                m = _EXPERT.match(name)
                fused = _FUSED.match(name)
                if m:
                    experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
                elif fused and fused.group(2) == "gate_up_proj":
                    gate, up = t.chunk(2, dim=1)
                    tensors[f"{fused.group(1)}.gate_proj"] = gate
                    tensors[f"{fused.group(1)}.up_proj"] = up
                else:
                    tensors[name] = t
    for (prefix, proj), per in experts.items():
        n = cfg.n_routed_experts
        missing = [e for e in range(n) if e not in per]
        if missing:
            raise CheckpointError(f"checkpoint: missing tensor {prefix}.{missing[0]}.{proj}.weight")
        extra = [e for e in per if e >= n]
        if extra:
            raise CheckpointError(f"checkpoint: unexpected tensor {prefix}.{extra[0]}.{proj}.weight")
        shapes = {tuple(t.shape) for t in per.values()}
        if len(shapes) != 1:
            raise CheckpointError(f"checkpoint: experts of {prefix}.*.{proj}.weight have different shapes {shapes}")
        tensors[f"{prefix}.{proj}"] = torch.stack([per[e] for e in range(n)])
    return tensors


def load_model(model: str | Path, dtype: str | torch.dtype = "fp32", device: str = "cpu") -> CausalLM:
    from engine.model.tiny import resolve_model_dir

    path = Path(resolve_model_dir(model))
    cfg = ModelConfig.from_dir(path)
    torch_dtype = parse_dtype(dtype)
    with torch.device("meta"):
        lm = CausalLM(cfg)
    expected = {k: v for k, v in lm.state_dict().items()}
    tensors = read_state_dict(path, cfg)
    if cfg.tie_word_embeddings and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    for name in expected:
        if name not in tensors:
            raise CheckpointError(f"checkpoint: missing tensor {name}")
    for name, t in tensors.items():
        if name not in expected:
            raise CheckpointError(f"checkpoint: unexpected tensor {name}")
        if tuple(t.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"checkpoint: tensor {name} has shape {tuple(t.shape)}, expected {tuple(expected[name].shape)}"
            )
    keep_fp32 = ("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight")
    # Fresh, aligned copies (not views of the mmapped file): BLAS results can depend on alignment,
    # and every rank must compute bit-for-bit what the reference computes.
    state = {n: t.to(device=device, dtype=torch.float32 if n.endswith(keep_fp32) else torch_dtype, copy=True)
             for n, t in tensors.items()}
    lm.load_state_dict(state, strict=True, assign=True)
    lm.rotary = type(lm.rotary)(cfg, device)
    lm.eval()
    lm.bind_attributes()
    return lm
