"""Model configuration, read from a Hugging Face `config.json`.

One frozen dataclass covers the three supported model types:

- ``deepseek_v3``  — MLA, dense attention; MLP/MoE chosen by ``first_k_dense_replace``.
- ``deepseek_v32`` — MLA + DSA indexer on every layer (indexer rotary is half-split).
- ``glm_moe_dsa``  — MLA + DSA with index sharing: ``indexer_types`` says which layers run
  their own indexer ("full") and which reuse the previous full layer's selection ("shared").

Derived values (latent width, which layers store index keys, ...) are properties, so a config
is never mutated after construction.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "kimi_k2")
# Model types that are another name for an architecture we implement.
ALIASES = {"kimi_k2": "deepseek_v3"}
# quantization_config keys we understand, and what each means for loading (see QuantConfig).
QUANT_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "scale_fmt",
              "modules_to_not_convert"}


class ModelConfigError(ValueError):
    """A checkpoint's config is unusable; the message names the field."""


@dataclass(frozen=True)
class QuantConfig:
    """FP8 block-quantized weights (DeepSeek-V3's release format), dequantized at load time.

    Accepted keys of ``quantization_config`` and why loading may ignore some of them:
    ``quant_method: fp8`` and ``fmt: e4m3`` (weights are ``float8_e4m3fn``);
    ``activation_scheme: dynamic`` (activations would be quantized per call at run time; we
    compute in the dequantized dtype, so no activation scales exist to read — ``static`` would
    ship them and is refused); ``weight_block_size: [b0, b1]`` (one float32 ``scale_inv`` per
    b0×b1 block); ``scale_fmt`` (``ue8m0`` in DeepSeek-V3.1/V3.2: the stored float32 scales are
    powers of two; the multiply is the same, so any value stored as a float is read as is);
    ``modules_to_not_convert`` (which weights stay unquantized — we find that from the files:
    a weight is FP8 exactly when its dtype is float8_e4m3fn and it has a ``_scale_inv`` partner).
    """

    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str | None = None


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # "default" or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    mlp_layer_types: tuple[str, ...] = ()
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    index_topk: int = 0
    index_head_dim: int = 0
    index_n_heads: int = 0
    indexer_types: tuple[str, ...] = ()  # per layer: "full", "shared" or "none"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    quant: QuantConfig | None = None  # FP8 block weights (config.json's quantization_config)
    # generation_config.json's temperature / top_p / top_k: defaults for requests that set none
    sampling_defaults: tuple[tuple[str, float], ...] = ()

    # ---- derived -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token per layer in the MLA cache: compressed KV + shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def has_indexer(self) -> bool:
        return any(t == "full" for t in self.indexer_types)

    @property
    def indexer_layer_ids(self) -> tuple[int, ...]:
        """Layers that run the DSA indexer and therefore store index keys."""
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    @property
    def num_indexer_layers(self) -> int:
        return len(self.indexer_layer_ids)

    @property
    def indexer_rope_interleave(self) -> bool:
        return self.model_type == "glm_moe_dsa"

    @property
    def mla_rope_interleave(self) -> bool:
        return self.rope_interleave if self.model_type == "deepseek_v3" else True

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale, with yarn's mscale correction as transformers applies it."""
        scale = self.qk_head_dim ** -0.5
        r = self.rope
        if r.type != "default" and r.mscale_all_dim:
            m = yarn_get_mscale(r.factor, r.mscale_all_dim)
            scale = scale * m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"

    def index_slot(self, layer: int) -> int:
        """Position of `layer` among the indexer layers (its row in the index-key pool)."""
        return self.indexer_layer_ids.index(layer)

    def fingerprint_fields(self) -> dict[str, Any]:
        """What must agree between a prefill and a decode group (weights' storage format aside)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("quant", "sampling_defaults")}

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"config.json: model_type {model_type!r} is not supported; expected one of {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        model_type = ALIASES.get(model_type, model_type)
        _check_implemented(raw)
        quant = _quant_config(raw.get("quantization_config"))

        def req(name: str) -> Any:
            if raw.get(name) is None:
                raise ModelConfigError(f"config.json: missing required field {name!r} for {model_type}")
            return raw[name]

        num_layers = int(req("num_hidden_layers"))
        first_dense = int(raw.get("first_k_dense_replace") or 0)
        if model_type == "deepseek_v3" or not raw.get("mlp_layer_types"):
            n_dense = min(first_dense, num_layers)
            mlp_types = ("dense",) * n_dense + ("sparse",) * (num_layers - n_dense)
        else:
            mlp_types = tuple(raw["mlp_layer_types"])
        if int(raw.get("n_routed_experts") or 0) == 0:
            mlp_types = ("dense",) * num_layers
        if len(mlp_types) != num_layers or any(t not in ("dense", "sparse") for t in mlp_types):
            raise ModelConfigError("config.json: mlp_layer_types must list 'dense'/'sparse' once per layer")

        if model_type == "deepseek_v3":
            indexer_types = ("none",) * num_layers
        elif model_type == "deepseek_v32":
            indexer_types = ("full",) * num_layers
        else:
            indexer_types = _glm_indexer_types(raw, num_layers)
        if indexer_types and indexer_types[0] == "shared":
            raise ModelConfigError("config.json: indexer_types[0] is 'shared' but no earlier layer runs the indexer")

        if model_type != "deepseek_v3":
            for name in ("index_topk", "index_head_dim", "index_n_heads", "q_lora_rank"):
                req(name)
            if int(raw["index_head_dim"]) < int(raw["qk_rope_head_dim"]):
                raise ModelConfigError("config.json: index_head_dim must be at least qk_rope_head_dim")

        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        n_experts = int(raw.get("n_routed_experts") or 0)
        n_group = int(raw.get("n_group") or 1)
        if n_experts and n_experts % n_group:
            raise ModelConfigError("config.json: n_routed_experts must be divisible by n_group")
        heads = int(req("num_attention_heads"))
        if raw.get("num_key_value_heads") not in (None, heads):
            raise ModelConfigError("config.json: num_key_value_heads must equal num_attention_heads for MLA")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")

        return cls(
            model_type=model_type,
            vocab_size=int(req("vocab_size")),
            hidden_size=int(req("hidden_size")),
            intermediate_size=int(req("intermediate_size")),
            num_layers=num_layers,
            num_heads=heads,
            kv_lora_rank=int(req("kv_lora_rank")),
            qk_nope_head_dim=int(req("qk_nope_head_dim")),
            qk_rope_head_dim=int(req("qk_rope_head_dim")),
            v_head_dim=int(req("v_head_dim")),
            q_lora_rank=int(raw["q_lora_rank"]) if raw.get("q_lora_rank") else None,
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            n_routed_experts=n_experts,
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
            n_group=n_group,
            topk_group=int(raw.get("topk_group") or 1),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
            mlp_layer_types=mlp_types,
            rms_norm_eps=float(raw.get("rms_norm_eps") or 1e-6),
            max_position_embeddings=int(raw.get("max_position_embeddings") or 4096),
            rope=_rope_config(raw),
            rope_interleave=bool(raw.get("rope_interleave", True)),
            attention_bias=bool(raw.get("attention_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            hidden_act=act,
            index_topk=int(raw.get("index_topk") or 0) if model_type != "deepseek_v3" else 0,
            index_head_dim=int(raw.get("index_head_dim") or 0) if model_type != "deepseek_v3" else 0,
            index_n_heads=int(raw.get("index_n_heads") or 0) if model_type != "deepseek_v3" else 0,
            indexer_types=indexer_types,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            quant=quant,
        )

    @classmethod
    def from_dir(cls, path: str | Path, generation_config: str = "auto") -> "ModelConfig":
        """config.json, and generation_config.json when the checkpoint has one: its
        ``eos_token_id`` (an int or a list) are stop ids before config.json's, and its
        temperature / top_p / top_k become ``sampling_defaults`` (as vLLM's
        ``--generation-config auto``); ``generation_config="none"`` ignores the file."""
        if generation_config not in ("auto", "none"):
            raise ModelConfigError(f"generation_config: {generation_config!r} is not one of auto, none")
        cfg = cls.from_dict(_read_json(Path(path) / "config.json", required=True, where=path))
        if generation_config == "none":
            return cfg
        gen = _read_json(Path(path) / "generation_config.json", required=False, where=path)
        if not gen:
            return cfg
        eos = gen.get("eos_token_id")
        eos = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        if any(not isinstance(e, int) or isinstance(e, bool) or not 0 <= e < cfg.vocab_size for e in eos):
            raise ModelConfigError(f"generation_config.json: eos_token_id {gen.get('eos_token_id')!r} must be token "
                                   f"ids in [0, {cfg.vocab_size})")
        defaults = []
        for name in ("temperature", "top_p", "top_k"):
            v = gen.get(name)
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ModelConfigError(f"generation_config.json: {name} must be a number, got {v!r}")
                defaults.append((name, float(v)))
        from dataclasses import replace

        return replace(cfg, eos_token_ids=tuple(dict.fromkeys([*eos, *cfg.eos_token_ids])),
                       sampling_defaults=tuple(defaults))

    @classmethod
    def load(cls, model: str | Path, generation_config: str = "auto") -> "ModelConfig":
        """`model` is a checkpoint directory or ``"tiny"`` (the embedded model)."""
        from engine.model.tiny import resolve_model_dir

        return cls.from_dir(resolve_model_dir(model), generation_config)


# config value → the values this code implements (None in the file means the default, which is
# what transformers' DeepSeek-V3 family runs).
_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "scoring_func": ("sigmoid",),  # Router: sigmoid scores + e_score_correction_bias
    "topk_method": ("noaux_tc",),  # grouped top-k on bias-corrected scores (DeepSeek-V3)
    "moe_layer_freq": (1,),  # every layer past first_k_dense_replace is MoE
}


def _check_implemented(raw: dict[str, Any]) -> None:
    for name, ok in _IMPLEMENTED.items():
        v = raw.get(name)
        if v is not None and v not in ok:
            raise ModelConfigError(f"config.json: {name} {v!r} is not implemented "
                                   f"(supported: {', '.join(repr(x) for x in ok)})")


def _quant_config(q: Any) -> QuantConfig | None:
    """Check ``quantization_config`` before any tensor is read (see QuantConfig)."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ModelConfigError("config.json: quantization_config must be an object")
    method = q.get("quant_method")
    if method != "fp8":
        raise ModelConfigError(f"config.json: quantization_config.quant_method {method!r} is not supported "
                               "(only 'fp8' block weights)")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ModelConfigError(f"config.json: quantization_config.fmt {q.get('fmt')!r} is not supported (only 'e4m3')")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ModelConfigError(f"config.json: quantization_config.activation_scheme {q.get('activation_scheme')!r} "
                               "is not supported (only 'dynamic')")
    unknown = sorted(set(q) - QUANT_KEYS)
    if unknown:
        raise ModelConfigError(f"config.json: quantization_config has keys this loader does not know: "
                               f"{', '.join(unknown)}")
    block = q.get("weight_block_size") or [128, 128]
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ModelConfigError(f"config.json: quantization_config.weight_block_size must be two positive "
                               f"integers, got {block!r}")
    return QuantConfig(weight_block_size=(block[0], block[1]), scale_fmt=q.get("scale_fmt"))


def _read_json(p: Path, required: bool, where) -> dict[str, Any] | None:
    if not p.is_file():
        if required:
            raise ModelConfigError(f"model: no {p.name} in {where}")
        return None
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"model: {p} is not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ModelConfigError(f"model: {p} must hold a JSON object")
    return raw


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _glm_indexer_types(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    types = raw.get("indexer_types")
    if types is None:
        pattern = raw.get("index_topk_pattern")
        if pattern is not None:
            types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            freq = max(int(raw.get("index_topk_freq", 1)), 1)
            offset = int(raw.get("index_skip_topk_offset", 2))
            types = ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(num_layers)]
    types = tuple(types)
    if len(types) != num_layers or any(t not in ("full", "shared") for t in types):
        raise ModelConfigError("config.json: indexer_types must list 'full'/'shared' once per layer")
    return types


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    if not params:
        params = dict(legacy)
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rtype = params.get("rope_type") or params.get("type") or "default"
    if rtype not in ("default", "yarn"):
        raise ModelConfigError(f"config.json: rope type {rtype!r} is not supported (default, yarn)")
    factor = params.get("factor")
    omax = params.get("original_max_position_embeddings")
    if rtype == "yarn":
        if omax is None:
            raise ModelConfigError("config.json: yarn rope needs rope_parameters.original_max_position_embeddings")
        if factor is None:
            factor = raw.get("max_position_embeddings", omax) / omax
    return RopeConfig(
        theta=float(params["rope_theta"]),
        type=rtype,
        factor=float(factor or 1.0),
        original_max_position_embeddings=int(omax) if omax is not None else None,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )
