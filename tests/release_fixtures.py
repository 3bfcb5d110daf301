"""Checkpoints in the formats real releases use, written with transformers' own model classes.

- ``fp8_release``: DeepSeek-V3's FP8 block format — every 2-D projection weight as
  ``float8_e4m3fn`` with a float32 ``weight_scale_inv`` per 128×128 block, sharded with an
  index, some weights in a different shard than their scale, plus a multi-token-prediction
  layer at index ``num_hidden_layers``.
- ``bf16_glm_release``: a bf16 ``glm_moe_dsa`` whose "shared" layers still ship indexer weights.
- ``add_kv_scales``: FP8-cache scales as quantization tools ship them, one ``k_scale`` and one
  ``v_scale`` scalar per layer in a shard of their own (the multi-token-prediction layer too).
- both with a byte-level BPE ``tokenizer.json``, a ``tokenizer_config.json`` (``add_bos_token``,
  a Jinja chat template) and a ``generation_config.json`` listing two eos ids;
  ``remote_code_tokenizer`` turns a directory's tokenizer into one that needs
  ``trust_remote_code`` (a Python tokenizer class named by ``auto_map``).

The quantizer and the dequantizer here are the test's own (block loops, independent of the
loader's code). Ground truth is the transformers model in fp32 on the dequantized weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.hf_models import build_hf

BLOCK = 128
FP8_MAX = 448.0
# Not quantized in DeepSeek's releases: embeddings, head, norms, router gate, biases.
_KEEP = ("embed_tokens", "lm_head", "norm", "mlp.gate.", "e_score_correction_bias", "indexer.weights_proj")


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, inp = w.shape
    rows, cols = math.ceil(out / BLOCK), math.ceil(inp / BLOCK)
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    s = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            scale = max(float(blk.abs().max()) / FP8_MAX, 1e-12)
            s[i, j] = scale
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (blk / scale).to(torch.float8_e4m3fn)
    return q, s


def dequantize_blocks(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    w = q.float().clone()
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] *= s[i, j]
    return w


def _quantizable(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith(".weight") and not any(k in name for k in _KEEP)


def write_shards(path: Path, tensors: dict[str, torch.Tensor], shards: list[list[str]]) -> None:
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in names}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


FP8_OVERRIDES = dict(hidden_size=320, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                     q_lora_rank=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                     intermediate_size=200, moe_intermediate_size=160)


def fp8_release(path: Path, model_type: str = "deepseek_v3", seed: int = 0):
    """An FP8 block-quantized release; returns the fp32 transformers model holding the
    dequantized weights (the ground truth)."""
    hf = build_hf("deepseek_v3", path, seed=seed, **FP8_OVERRIDES)
    raw = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    out, deq = {}, {}
    for name, t in raw.items():
        if _quantizable(name, t):
            q, s = quantize_blocks(t)
            out[name], out[name + "_scale_inv"] = q, s
            deq[name] = dequantize_blocks(q, s)
        else:
            out[name] = t.to(torch.bfloat16)  # releases ship the rest in bf16
            deq[name] = out[name].float()
    # A multi-token-prediction layer past the last layer (as DeepSeek-V3 ships it): a copy of layer 0's
    # tensors under the next index, plus its own projections.
    n = FP8_OVERRIDES["num_hidden_layers"]
    for name in [k for k in out if k.startswith("model.layers.0.")]:
        out[name.replace("model.layers.0.", f"model.layers.{n}.")] = out[name].clone()
    h = FP8_OVERRIDES["hidden_size"]
    q, s = quantize_blocks(0.05 * torch.randn(h, 2 * h))
    out[f"model.layers.{n}.eh_proj.weight"], out[f"model.layers.{n}.eh_proj.weight_scale_inv"] = q, s
    out[f"model.layers.{n}.enorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    # Three shards; every kv_a_proj_with_mqa weight sits in another shard than its scale.
    names = sorted(out)
    kv_a = [k for k in names if "kv_a_proj_with_mqa.weight" in k and not k.endswith("_scale_inv")]
    kv_a_scales = [k + "_scale_inv" for k in kv_a]
    rest = [k for k in names if k not in kv_a and k not in kv_a_scales]
    write_shards(path, out, [kv_a + rest[::2], kv_a_scales + rest[1::2]])
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type=model_type, dtype="bfloat16", num_nextn_predict_layers=1, scoring_func="sigmoid",
               topk_method="noaux_tc",
               quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [BLOCK, BLOCK], "scale_fmt": "ue8m0"})
    cfg.pop("torch_dtype", None)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    release_tokenizer(path, cfg["vocab_size"])
    _assign(hf, deq)
    return hf.float().eval()


def add_kv_scales(path: Path, k_scales: list[float], name: str = "k_scale") -> None:
    """Write per-layer KV-cache scales (``model.layers.{i}.self_attn.{name}`` and ``v_scale``,
    float32 scalars) into a new shard listed in the index; one extra layer's scale for the
    multi-token-prediction layer when the config has one."""
    cfg = json.loads((path / "config.json").read_text())
    layers = cfg["num_hidden_layers"] + cfg.get("num_nextn_predict_layers", 0)
    scales = list(k_scales) + [1.0] * (layers - len(k_scales))
    tensors = {}
    for layer, k in enumerate(scales):
        tensors[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor(k, dtype=torch.float32)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(2 * k, dtype=torch.float32)
    save_file(tensors, str(path / "kv-scales.safetensors"), metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if not index.exists():  # a single-file checkpoint becomes a sharded one
        single = load_file(str(path / "model.safetensors"))
        (path / "model.safetensors").rename(path / "model-weights.safetensors")
        doc = {"metadata": {}, "weight_map": {n: "model-weights.safetensors" for n in single}}
    else:
        doc = json.loads(index.read_text())
    doc["weight_map"].update({n: "kv-scales.safetensors" for n in tensors})
    index.write_text(json.dumps(doc))


def _assign(hf, tensors: dict[str, torch.Tensor]) -> None:
    """Copy on-disk tensors (per-expert names) into transformers' in-memory model (fused experts)."""
    import re

    state = hf.state_dict()
    expert = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    with torch.no_grad():
        for name, t in tensors.items():
            m = expert.match(name)
            if name in state:
                state[name].copy_(t.float())
            elif m:
                e = int(m.group(2))
                if m.group(3) == "down_proj":
                    state[f"{m.group(1)}.down_proj"][e].copy_(t.float())
                else:
                    fused = state[f"{m.group(1)}.gate_up_proj"][e]
                    half = fused.shape[0] // 2
                    (fused[:half] if m.group(3) == "gate_proj" else fused[half:]).copy_(t.float())
            elif not name.startswith("model.layers.") or int(name.split(".")[2]) < hf.config.num_hidden_layers:
                if ".indexer." not in name:
                    raise AssertionError(f"fixture: {name} has no in-memory counterpart")


def bf16_glm_release(path: Path, seed: int = 0):
    """A bf16 glm_moe_dsa whose 'shared' layers still ship indexer weights; returns the fp32
    transformers model on the bf16-rounded weights."""
    hf = build_hf("glm_moe_dsa", path, seed=seed)
    raw = load_file(str(path / "model.safetensors"))
    out = {k: v.to(torch.bfloat16) for k, v in raw.items()}
    cfg = json.loads((path / "config.json").read_text())
    pattern = cfg.get("indexer_types") or ["full" if c == "F" else "shared" for c in cfg["index_topk_pattern"]]
    full = pattern.index("full")
    for layer, kind in enumerate(pattern):
        if kind == "shared":
            for k in [k for k in out if k.startswith(f"model.layers.{full}.self_attn.indexer.")]:
                out[k.replace(f"model.layers.{full}.", f"model.layers.{layer}.")] = out[k].clone()
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg.update(dtype="bfloat16")
    cfg.pop("torch_dtype", None)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    release_tokenizer(path, cfg["vocab_size"])
    _assign(hf, out)
    return hf.float().eval()


# ---- tokenizer folders --------------------------------------------------------------------------
BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜pad｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
# DeepSeek-V3's template, shortened: BOS, the system prompt, then User / Assistant turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages if m['role'] == 'system' %}{{ m['content'] }}{% endfor %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}" + USER + "{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}" + ASSISTANT + "{{ m['content'] }}" + EOS + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}")
# Trains the merges: ASCII words and CJK characters, so some tokens hold part of a character.
CORPUS = ["Context parallelism splits long prompts across ranks. ", "the quick brown fox jumps over the lazy dog ",
          "长上下文 并行 解码 预填充 长上下文 长上下文 ", "naïve café über façade ", "✓ ✓ ✓ → → → "] * 20


def release_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE ``tokenizer.json`` trained on :data:`CORPUS` (DeepSeek's special tokens at
    ids 0..4, BOS added by the post-processor), a ``tokenizer_config.json`` with
    ``add_bos_token: true`` and a Jinja chat template, and a ``generation_config.json`` whose
    ``eos_token_id`` is a list (EOS and the User token, as GLM's lists its turn tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [BOS, EOS, PAD, USER, ASSISTANT]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, 0)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizerFast", "add_bos_token": True, "add_eos_token": False,
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "model_max_length": 16384,
        "clean_up_tokenization_spaces": False, "legacy": True, "chat_template": CHAT_TEMPLATE}, indent=2))
    (path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 0, "eos_token_id": [1, specials.index(USER)], "do_sample": True, "temperature": 0.6,
        "top_p": 0.95}, indent=2))


REMOTE_CODE = '''
"""A byte tokenizer shipped as code with its checkpoint (as Kimi-K2 ships its tiktoken one)."""
from transformers import PreTrainedTokenizer


class ByteCodeTokenizer(PreTrainedTokenizer):
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, **kwargs):
        kwargs.setdefault("bos_token", "[BOS]")
        kwargs.setdefault("eos_token", "[EOS]")
        kwargs.setdefault("pad_token", "[PAD]")
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return 259

    def get_vocab(self):
        vocab = {"[BOS]": 0, "[EOS]": 1, "[PAD]": 2, **{f"<0x{b:02X}>": b + 3 for b in range(256)}}
        vocab.update(self.added_tokens_encoder)
        return vocab

    def _tokenize(self, text, **kwargs):
        return [f"<0x{b:02X}>" for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token):
        return self.get_vocab().get(token, 2)

    def _convert_id_to_token(self, index):
        return {0: "[BOS]", 1: "[EOS]", 2: "[PAD]"}.get(index) or f"<0x{index - 3:02X}>"

    def convert_tokens_to_string(self, tokens):
        data = bytes(int(t[3:5], 16) for t in tokens if t.startswith("<0x") and len(t) == 6)
        return data.decode("utf-8", errors="replace")

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        return [self.bos_token_id] + token_ids_0 + ([] if token_ids_1 is None else [self.bos_token_id] + token_ids_1)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''


def remote_code_tokenizer(path: Path) -> None:
    """A tokenizer that only loads with trust_remote_code: ``auto_map`` points AutoTokenizer at a
    Python (slow) tokenizer class in the checkpoint directory. Byte ids as the tiny models'."""
    (path / "tokenization_bytecode.py").write_text(REMOTE_CODE)
    for stale in ("tokenizer.json",):
        (path / stale).unlink(missing_ok=True)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "ByteCodeTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_bytecode.ByteCodeTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "chat_template": CHAT_TEMPLATE}, indent=2))
