"""CPU kernels in C, compiled on first use with the machine's C compiler and loaded with ctypes.

Why C and not a torch extension: the kernel needs no torch headers (it takes raw pointers), so
it builds in well under a second with plain ``cc``, where ``torch.utils.cpp_extension`` takes a
minute and needs ninja. It runs on torch's own OpenMP runtime (``libgomp.so.1``, which torch
has loaded before the kernel is), so it shares torch's threads instead of adding a pool.

Builds are cached under ``<cache dir>/kernels`` by a hash of the source, the flags, the
compiler's version and this CPU's feature flags (``-march=native`` code must not run on another
CPU). Concurrent first uses (the ranks of a group start together) each compile to a temporary
file and rename it into place, so they never see half a library.

The library holds the fused decode attention (``mla_decode``) and a helper of the DCP
exchange around it (``dcp_pack``). ``CPSERVE_DECODE_ATTENTION=torch`` turns them off (the
torch paths in engine/cache/gather.py and engine/parallel/dcp.py then run); without a C compiler
they are off too, said once in the log.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

ENV = "CPSERVE_DECODE_ATTENTION"  # auto (default) | fused | torch
SOURCE = Path(__file__).with_name("mla_decode.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
SEG = 256  # rows per work item; must equal SEG in mla_decode.c (checked against the library)
BLK = 16  # rows per block (FP8 rows are decoded a block at a time); BLK in mla_decode.c
KINDS = {"fp32": 0, "fp8": 1, "fp8_ds_mla": 2}  # the row layouts the kernel reads (KIND_* in mla_decode.c)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _build(cc: str, out_dir: Path) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, platform.machine(),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    lib = out_dir / f"mla_decode-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _library() -> ctypes.CDLL | None:
    """The kernels' shared library (built once, then loaded from the cache), or None when they
    are turned off or cannot be built (the reason is logged)."""
    mode = os.environ.get(ENV, "auto")
    if mode not in ("auto", "fused", "torch"):
        raise ValueError(f"{ENV}: expected auto, fused or torch, got {mode!r}")
    if mode == "torch":
        return None
    cc = _compiler()
    try:
        if cc is None:
            raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
        from engine.model.tiny import cache_dir

        import torch  # noqa: F401  (loads torch's libgomp first, so the kernel shares its runtime)

        lib = ctypes.CDLL(str(_build(cc, cache_dir() / "kernels")))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        if mode == "fused":
            raise RuntimeError(f"{ENV}=fused but the decode kernel is unavailable: {e}") from e
        logger.warning("fused decode attention unavailable (%s); using the torch path", e)
        return None
    if lib.mla_decode_seg() != SEG or lib.mla_decode_block() != BLK:
        raise RuntimeError("engine/kernels: mla_decode.c and its loader disagree on SEG or BLK")
    return lib


@functools.cache
def mla_decode():
    """The fused decode-attention function (ctypes), or None when the kernels are turned off or
    cannot be built (the reason is logged once)."""
    lib = _library()
    if lib is None:
        return None
    logger.info("fused decode attention: %s", lib._name)
    fn = lib.mla_decode
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    fn.argtypes = [p, i64, i32, f32, i64, p, p, p, p, i64, i64, i64, f32, p, p, p, p, p, i32]
    fn.restype = None
    return fn


@functools.cache
def dcp_pack():
    """The DCP a2a exchange's packing (dcp_pack in mla_decode.c), or None where ``mla_decode``
    is (the torch path in engine/parallel/dcp.py then runs)."""
    lib = _library() if mla_decode() is not None else None
    if lib is None:
        return None
    fn = lib.dcp_pack
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes, fn.restype = [p, p, i64, i64, i64, i64, p], None
    return fn
