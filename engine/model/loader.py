"""Load a checkpoint (config.json + safetensors, single file or sharded) into :class:`CausalLM`.

Two passes, so a checkpoint that cannot load is refused before any tensor data is read:

1. **Check** (:func:`inspect_checkpoint`): config.json, the shard index and every shard's
   safetensors header (the 8-byte length and the JSON header only — read with plain file
   reads, never the data region). Every name, dtype and shape is checked against the model;
   the error lists the missing, unexpected and mis-shaped tensors (first few and a count) and
   the file each came from.
2. **Stream** (:func:`load_model`): every parameter is allocated once in its compute dtype and
   filled tensor by tensor from the files; FP8 block weights are dequantized as they are read.

Tensor names are the ones transformers writes. Routed experts may come per expert
(``mlp.experts.{e}.gate_proj.weight`` …, as DeepSeek and transformers' ``save_pretrained``
write them) or fused (``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``); both fill our
stacked ``[E, …]`` parameters.

FP8 block weights (``quantization_config.quant_method: fp8``, see
:class:`engine.model.config.QuantConfig`): a ``float8_e4m3fn`` weight ``W`` [out, in] with a
float32 partner ``<name>_scale_inv`` [ceil(out/b0), ceil(in/b1)] — found in the files (the
partner may sit in another shard), not from a list of names — is
``W[i, j] * scale_inv[i // b0, j // b1]``, multiplied in float32 and cast once to the compute
dtype (never through bf16 when computing in fp32: that changes greedy tokens).

Skipped with one log line that counts them: multi-token-prediction layers (index ≥
``num_hidden_layers``), indexer weights on GLM "shared" layers (which reuse an earlier layer's
selection), rotary ``inv_freq`` buffers.

KV-cache scales: FP8-cache checkpoints ship one scalar per layer, ``model.layers.{i}.self_attn.
k_scale`` (or ``kv_scale``, or under ``self_attn.attn.``, as vLLM names them), plus ``v_scale``.
They are no parameters: :func:`read_kv_scales` reads them for the ``fp8`` cache format
(engine/cache/kvformat.py), which stores each entry as e4m3(x / k_scale). MLA caches one latent
for keys and values, so ``v_scale`` is accepted and not used (as vLLM's MLA backends do).
"""

from __future__ import annotations

import json
import logging
import math
import re
import struct
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from engine.model.config import ModelConfig
from engine.model.model import CausalLM

logger = logging.getLogger("cpserve.loader")

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.)?(k_scale|kv_scale|v_scale)$")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32")
# safetensors header dtype → what it means for loading
_FLOAT = {"F32", "BF16", "F16"}
_FP8 = "F8_E4M3"
_KEEP_FP32 = ("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight")
_SHOW = 5  # names listed per kind of problem


class CheckpointError(ValueError):
    """The checkpoint does not fit the model; the message names the tensor(s) and file(s)."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype: {name!r} is not supported; use one of {', '.join(DTYPE_CHOICES)}")
    return _DTYPES[name]


def resolve_dtype(name: str, cfg: ModelConfig) -> str:
    """``auto`` → the checkpoint's ``torch_dtype``/``dtype`` (bf16 for an FP8 release, whose
    config says bfloat16); any other name is checked and returned in its short form."""
    if name == "auto":
        name = cfg.torch_dtype if cfg.torch_dtype in _DTYPES else "bfloat16"
    dt = parse_dtype(name)
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dt]


# ---- pass 1: headers only ----------------------------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors dtype string (F32, BF16, F8_E4M3, ...)
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        size = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F64": 8, "I64": 8, "I32": 4}.get(self.dtype, 4)
        return math.prod(self.shape) * size


def read_header(path: Path) -> dict[str, TensorInfo]:
    """A safetensors file's tensor table from its header alone (no data bytes are read)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"checkpoint: {path.name} is not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            size = path.stat().st_size
            if n > min(size - 8, 100 << 20):
                raise CheckpointError(f"checkpoint: {path.name} has a corrupt header (length {n})")
            header = json.loads(fh.read(n))
    except OSError as e:
        raise CheckpointError(f"checkpoint: cannot read {path}: {e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint: {path.name} has a corrupt header ({e})") from None
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            out[name] = TensorInfo(name, path, str(meta["dtype"]), tuple(int(d) for d in meta["shape"]))
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"checkpoint: {path.name}: header entry {name!r} is malformed") from None
    return out


def _shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except json.JSONDecodeError as e:
            raise CheckpointError(f"checkpoint: {index.name} is not valid JSON ({e})") from None
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


def _skipped(name: str, cfg: ModelConfig) -> str | None:
    """Why a tensor the checkpoint ships is not used for inference (None: it is used)."""
    if name.endswith("rotary_emb.inv_freq"):
        return "rotary buffer"
    if _KV_SCALE.match(name):
        return "kv-cache scale (read by the cache format, not a weight)"
    m = _LAYER.match(name)
    if m:
        layer = int(m.group(1))
        if layer >= cfg.num_layers:
            return "multi-token-prediction layer"
        if ".self_attn.indexer." in name and cfg.indexer_types[layer] != "full":
            return "indexer of a layer that reuses an earlier layer's index"
    return None


@dataclass(frozen=True)
class Source:
    """Where one parameter (or one expert's slice of it) comes from."""

    tensor: TensorInfo
    scale: TensorInfo | None = None  # FP8 block scale (``weight_scale_inv``)
    expert: int | None = None  # slot in a stacked [E, ...] parameter
    chunk: int | None = None  # fused gate_up_proj: 0 = gate half, 1 = up half


@dataclass
class CheckpointPlan:
    """The checked map from our parameters to checkpoint tensors (pass 1's result)."""

    path: Path
    sources: dict[str, list[Source]] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    num_fp8: int = 0

    @property
    def nbytes(self) -> int:
        return sum(s.tensor.nbytes + (s.scale.nbytes if s.scale else 0) for v in self.sources.values() for s in v)


def _report(problems: dict[str, list[str]], path: Path) -> None:
    parts = []
    for kind, items in problems.items():
        if items:
            more = f" (and {len(items) - _SHOW} more)" if len(items) > _SHOW else ""
            parts.append(f"{len(items)} {kind}: " + "; ".join(items[:_SHOW]) + more)
    if parts:
        raise CheckpointError(f"checkpoint {path}: " + " | ".join(parts))


def inspect_checkpoint(path: Path, cfg: ModelConfig, expected: dict[str, tuple[int, ...]]) -> CheckpointPlan:
    """Pass 1: check every header against ``expected`` (our parameter name → shape)."""
    tensors: dict[str, TensorInfo] = {}
    for f in _shard_files(path):
        for name, info in read_header(f).items():
            if name in tensors:
                raise CheckpointError(f"checkpoint: tensor {name} is in both {tensors[name].file.name} and {f.name}")
            tensors[name] = info
    plan = CheckpointPlan(path)
    problems: dict[str, list[str]] = {"missing tensors": [], "unexpected tensors": [], "mis-shaped tensors": [],
                                      "tensors of an unsupported dtype": []}
    quant = cfg.quant
    scales = {n for n in tensors if n.endswith("_scale_inv")}
    used_scales: set[str] = set()

    def where(t: TensorInfo) -> str:
        return f"{t.name} ({t.file.name})"

    def source_of(info: TensorInfo, **kw) -> Source | None:
        scale = tensors.get(info.name + "_scale_inv")
        if info.dtype == _FP8:
            if quant is None:
                problems["tensors of an unsupported dtype"].append(
                    f"{where(info)} is float8_e4m3fn but config.json has no fp8 quantization_config")
                return None
            if scale is None:
                problems["missing tensors"].append(f"{info.name}_scale_inv (scale of the fp8 weight {where(info)})")
                return None
            used_scales.add(scale.name)
            b0, b1 = quant.weight_block_size
            grid = (math.ceil(info.shape[0] / b0), math.ceil(info.shape[1] / b1)) if len(info.shape) == 2 else None
            if grid is None or scale.shape != grid or scale.dtype not in _FLOAT:
                problems["mis-shaped tensors"].append(
                    f"{where(scale)} has shape {list(scale.shape)} ({scale.dtype}), expected {list(grid or ())} "
                    f"float scales for {list(info.shape)} in {b0}x{b1} blocks")
                return None
            plan.num_fp8 += 1
            return Source(info, scale, **kw)
        if info.dtype not in _FLOAT:
            problems["tensors of an unsupported dtype"].append(f"{where(info)} is {info.dtype}")
            return None
        if scale is not None:
            problems["unexpected tensors"].append(f"{where(scale)} (a scale for the non-fp8 {info.name})")
        return Source(info, **kw)

    for name, info in tensors.items():
        if name in scales:
            continue
        why = _skipped(name, cfg)
        if why is not None:
            plan.skipped[why] = plan.skipped.get(why, 0) + 1
            continue
        m, fused = _EXPERT.match(name), _FUSED.match(name)
        if m:
            target, shape = f"{m.group(1)}.{m.group(3)}", info.shape
            kw = {"expert": int(m.group(2))}
            exp = expected.get(target)
            if exp is not None and not 0 <= kw["expert"] < exp[0]:
                problems["unexpected tensors"].append(where(info))
                continue
            exp = exp[1:] if exp is not None else None
        elif fused:
            exp_full = expected.get(f"{fused.group(1)}.gate_proj" if fused.group(2) == "gate_up_proj"
                                    else f"{fused.group(1)}.down_proj")
            if fused.group(2) == "gate_up_proj":
                targets = [(f"{fused.group(1)}.gate_proj", 0), (f"{fused.group(1)}.up_proj", 1)]
                exp = None if exp_full is None else (exp_full[0], 2 * exp_full[1], exp_full[2])
            else:
                targets, exp = [(f"{fused.group(1)}.down_proj", None)], exp_full
            if exp is None:
                problems["unexpected tensors"].append(where(info))
                continue
            if info.shape != exp:
                problems["mis-shaped tensors"].append(f"{where(info)} has shape {list(info.shape)}, expected {list(exp)}")
                continue
            for target, chunk in targets:
                src = source_of(info, chunk=chunk)
                if src is not None:
                    plan.sources.setdefault(target, []).append(src)
            continue
        else:
            target, kw = name, {}
            exp = expected.get(name)
        if exp is None:
            problems["unexpected tensors"].append(where(info))
            continue
        if info.shape != tuple(exp):
            problems["mis-shaped tensors"].append(f"{where(info)} has shape {list(info.shape)}, expected {list(exp)}")
            continue
        src = source_of(info, **kw)
        if src is not None:
            plan.sources.setdefault(target, []).append(src)

    for s in sorted(scales - used_scales):
        base = s[: -len("_scale_inv")]
        if base in tensors and (_skipped(base, cfg) is not None):
            plan.skipped[_skipped(base, cfg)] = plan.skipped.get(_skipped(base, cfg), 0) + 1
        elif base not in tensors:
            problems["unexpected tensors"].append(f"{where(tensors[s])} (no weight {base})")
    if cfg.tie_word_embeddings and "lm_head.weight" not in plan.sources and "model.embed_tokens.weight" in plan.sources:
        plan.sources["lm_head.weight"] = plan.sources["model.embed_tokens.weight"]
    for name, shape in expected.items():
        got = plan.sources.get(name, [])
        if len(shape) == 3 and name.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj")) and got \
                and got[0].expert is not None:
            have = {s.expert for s in got}
            prefix, proj = name.rsplit(".", 1)
            problems["missing tensors"] += [f"{prefix}.{e}.{proj}.weight" for e in range(shape[0]) if e not in have]
        elif not got:
            problems["missing tensors"].append(name)
    _report(problems, path)
    return plan


def read_kv_scales(model: str | Path, cfg: ModelConfig) -> tuple[float, ...] | None:
    """The checkpoint's per-layer KV-cache scale (``k_scale``, else ``kv_scale``), or None when
    it ships none. Reads the headers and the scalars only. A checkpoint that has them for some
    layers and not others, or a scale that is not one finite positive float, is refused."""
    path = Path(model)
    found: dict[int, dict[str, TensorInfo]] = {}
    for f in _shard_files(path):
        for name, info in read_header(f).items():
            m = _KV_SCALE.match(name)
            if m and int(m.group(1)) < cfg.num_layers:
                found.setdefault(int(m.group(1)), {})[m.group(2)] = info
    keyed = {layer: kinds.get("k_scale") or kinds.get("kv_scale") for layer, kinds in found.items()}
    keyed = {layer: info for layer, info in keyed.items() if info is not None}
    if not keyed:
        return None
    missing = [f"model.layers.{l}.self_attn.k_scale" for l in range(cfg.num_layers) if l not in keyed]
    if missing:
        raise CheckpointError(f"checkpoint {path}: kv-cache scales for some layers only; missing "
                              + "; ".join(missing[:_SHOW]))
    scales = []
    for layer in range(cfg.num_layers):
        info = keyed[layer]
        if math.prod(info.shape) != 1 or info.dtype not in _FLOAT:
            raise CheckpointError(f"checkpoint: {info.name} ({info.file.name}) is {info.dtype} {list(info.shape)}, "
                                  "expected one float")
        with safe_open(str(info.file), framework="pt") as fh:
            value = float(fh.get_tensor(info.name).float().reshape(()))
        if not (math.isfinite(value) and value > 0):
            raise CheckpointError(f"checkpoint: {info.name} ({info.file.name}) is {value}, expected a finite scale > 0")
        scales.append(value)
    return tuple(scales)


# ---- pass 2: stream the data -------------------------------------------------------------------
def dequantize_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                          offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """``w[i, j] * scale_inv[(r0 + i) // b0, (c0 + j) // b1]`` in float32 (edge blocks partial).

    ``w`` may be a slice of the full weight starting at ``offset`` = (r0, c0); ``scale_inv``
    then holds the block rows and columns that slice touches, from block (r0 // b0, c0 // b1)."""
    b0, b1 = block
    r0, c0 = offset
    rows, cols = w.shape
    x = w.float()
    s = scale_inv.float()[:, torch.arange(c0, c0 + cols) // b1 - c0 // b1]  # one row of scales per block row
    first = r0 // b0
    for i in range(s.shape[0]):  # in place: one fp32 copy of the weight, not three
        lo, hi = max(0, (first + i) * b0 - r0), min(rows, (first + i + 1) * b0 - r0)
        if lo < hi:
            x[lo:hi].mul_(s[i])
    return x


class WeightShard(Protocol):
    """Which part of each parameter a process keeps (engine/parallel/shard.py)."""

    def check(self, cfg: ModelConfig) -> None: ...

    def part(self, cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None: ...

    def finish(self, lm: CausalLM) -> None: ...


def part_shape(part: tuple[slice, ...] | None, shape: tuple[int, ...]) -> tuple[int, ...]:
    if part is None:
        return tuple(shape)
    return tuple(len(range(*s.indices(d))) for s, d in zip(part, shape))


def _source_part(src: Source, part: tuple[slice, ...] | None, full: tuple[int, ...]):
    """(index into the local parameter, slices of the source tensor to read) for one source of
    a parameter of full shape ``full`` of which ``part`` is kept; None when none of it is."""
    if part is None:
        return (src.expert if src.expert is not None else ...), None
    if src.expert is not None:  # one expert's 2-D tensor of a stacked [E, ...] parameter
        e = part[0]
        if not e.start <= src.expert < e.stop:
            return None
        return src.expert - e.start, part[1:]
    if src.chunk is not None:  # fused gate_up_proj [E, 2I, H]: this half's rows sit at chunk·I
        inter = full[1]
        rows = slice(src.chunk * inter + part[1].start, src.chunk * inter + part[1].stop)
        return ..., (part[0], rows) + part[2:]
    return ..., part


def _read_bytes(info: TensorInfo, slices: tuple[slice, ...] | None) -> int:
    if slices is None:
        return info.nbytes
    return info.nbytes * math.prod(part_shape(slices, info.shape)) // max(math.prod(info.shape), 1)


def _progress(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover — tqdm is a dependency
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr,
                disable=None, leave=False, mininterval=0.5)


def local_shapes(cfg: ModelConfig, shard: WeightShard | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model (parameters and buffers) → its shape on a process holding
    ``shard`` of it (all of it without one)."""
    with torch.device("meta"):
        lm = CausalLM(cfg)
    if shard is not None:
        shard.check(cfg)
    return {name: part_shape(shard.part(cfg, name, tuple(t.shape)) if shard else None, tuple(t.shape))
            for name, t in lm.state_dict().items()}


def tensor_bytes(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of one loaded tensor: the router gate, its correction bias and the indexer's head
    weights stay fp32, the rest is in the compute dtype."""
    return math.prod(shape) * (4 if name.endswith(_KEEP_FP32) else dtype.itemsize)


def weight_bytes(cfg: ModelConfig, dtype: str = "auto", shard: WeightShard | None = None) -> int:
    """Bytes of the model's tensors once loaded in ``dtype`` by a process holding ``shard`` of
    them (the whole model without one)."""
    return weight_breakdown(cfg, dtype, shard)["total"]


_EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")


def weight_breakdown(cfg: ModelConfig, dtype: str = "auto", shard: WeightShard | None = None) -> dict[str, int]:
    """:func:`weight_bytes` by kind: ``routed_experts`` (``mlp.experts.*``, what expert
    parallelism splits), ``embeddings`` (``embed_tokens`` and ``lm_head``, replicated),
    ``other`` (attention, norms, router, shared experts, dense MLPs) and their ``total``."""
    torch_dtype = parse_dtype(resolve_dtype(dtype, cfg))
    out = dict.fromkeys(("routed_experts", "embeddings", "other", "total"), 0)
    for name, shape in local_shapes(cfg, shard).items():
        n = tensor_bytes(name, shape, torch_dtype)
        kind = "routed_experts" if ".mlp.experts." in name else "embeddings" if name in _EMBEDDINGS else "other"
        out[kind] += n
        out["total"] += n
    return out


def load_model(model: str | Path, dtype: str | torch.dtype = "fp32", device: str = "cpu",
               shard: WeightShard | None = None) -> CausalLM:
    """Check the checkpoint, then stream it into a :class:`CausalLM` in ``dtype``.

    With ``shard`` (a rank of a group), only the part of each tensor the shard keeps is read
    from the files (``safe_open(...).get_slice``): a rank's peak memory is its own weights."""
    from engine.model.tiny import resolve_model_dir

    path = Path(resolve_model_dir(model))
    cfg = ModelConfig.from_dir(path)
    torch_dtype = parse_dtype(resolve_dtype(dtype, cfg) if isinstance(dtype, str) else dtype)
    with torch.device("meta"):
        lm = CausalLM(cfg)
    meta = lm.state_dict()
    plan = inspect_checkpoint(path, cfg, {n: tuple(t.shape) for n, t in meta.items()})
    if shard is not None:
        shard.check(cfg)
    parts = {n: shard.part(cfg, n, tuple(t.shape)) if shard is not None else None for n, t in meta.items()}
    if plan.skipped:
        logger.info("checkpoint %s: skipped %s", path,
                    ", ".join(f"{n} tensor(s) of {why}" for why, n in sorted(plan.skipped.items())))
    reads = []  # (parameter, index into it, source, source slices)
    for name, sources in plan.sources.items():
        for src in sources:
            where = _source_part(src, parts[name], tuple(meta[name].shape))
            if where is not None:
                reads.append((name, where[0], src, where[1]))
    total = sum(_read_bytes(src.tensor, sl) + (src.scale.nbytes if src.scale else 0) for _, _, src, sl in reads)
    state: dict[str, torch.Tensor] = {}
    bar = _progress(total, f"loading {path.name}")
    with ExitStack() as stack:
        handles: dict[Path, object] = {}

        def read(info: TensorInfo, slices: tuple[slice, ...] | None = None) -> torch.Tensor:
            fh = handles.get(info.file)
            if fh is None:
                # pread, not mmap: an mmapped shard's touched pages stay in the process's RSS
                # until its handle closes (here: the end of the load), so the peak was the
                # weights plus the whole checkpoint's file-backed pages (2x weights for a bf16
                # checkpoint loaded as bf16). pread gives each tensor its own buffer, freed
                # once copied into the parameter (bench/load.py measures the peak).
                fh = handles[info.file] = stack.enter_context(
                    safe_open(str(info.file), framework="pt", backend="pread"))
            t = fh.get_tensor(info.name) if slices is None else fh.get_slice(info.name)[slices]
            if bar is not None:
                bar.update(_read_bytes(info, slices))
            return t

        def read_fp8(src: Source, slices: tuple[slice, ...] | None) -> torch.Tensor:
            b0, b1 = cfg.quant.weight_block_size
            if slices is None:
                return dequantize_fp8_blocks(read(src.tensor), read(src.scale), (b0, b1))
            rows, cols = (range(*s.indices(d)) for s, d in zip(slices, src.tensor.shape))
            grid = (slice(rows.start // b0, -(-rows.stop // b0)), slice(cols.start // b1, -(-cols.stop // b1)))
            return dequantize_fp8_blocks(read(src.tensor, slices), read(src.scale, grid), (b0, b1),
                                         (rows.start, cols.start))

        for name, at, src, slices in reads:
            if name not in state:
                dt = torch.float32 if name.endswith(_KEEP_FP32) else torch_dtype
                # Fresh, aligned memory (not views of the file's pages): BLAS results can depend
                # on alignment, and every rank must compute bit-for-bit what the reference does.
                state[name] = torch.empty(part_shape(parts[name], tuple(meta[name].shape)), dtype=dt, device=device)
            t = read_fp8(src, slices) if src.scale is not None else read(src.tensor, slices)
            if src.chunk is not None and parts[name] is None:
                t = t.chunk(2, dim=1)[src.chunk]
            state[name][at].copy_(t)
            del t
    if bar is not None:
        bar.close()
    for name, part in parts.items():  # the meta model takes the local shapes before the load
        if part is not None:
            owner, attr = name.rsplit(".", 1)
            setattr(lm.get_submodule(owner), attr,
                    torch.nn.Parameter(torch.empty(state[name].shape, device="meta"), requires_grad=False))
    lm.load_state_dict(state, strict=True, assign=True)
    lm.rotary = type(lm.rotary)(cfg, device)
    if shard is not None:
        shard.finish(lm)
    lm.eval()
    lm.bind_attributes()
    return lm
