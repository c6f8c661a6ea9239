"""The engine's compiled CPU kernels: 4- and 8-bit weights times float32 or 8-bit
activations, and the fused decode step -- built on purpose, loaded at start-up.

Why our own: decode reads every weight once per step, so it wants few bytes per weight, and
a batch of rows wants each unpacked weight block reused by every row.  PyTorch's weight-only
CPU kernels (``_weight_int4pack_mm_for_cpu``, ``_weight_int8pack_mm``) vectorise only bf16
activations on this CPU, and bf16 activations change a small model's greedy answers.  These
kernels read llama.cpp's own grids -- Q4_1 (``w = q * scale + min``, q in [0, 15]) and Q8_0
(``w = q * scale``) with one fp16 scale (and min) per 32 inputs -- in tiles of 16 output
rows (layouts: ``csrc/ops.h``), with two kinds of activations:

- float32 (the ``int4`` mode): the file's exact weights in float32 arithmetic, answers equal
  to the float32 mode's up to summation order;
- 8 bits per group of 32 (the ``int4-a8`` mode, llama.cpp's own arithmetic): integer dot
  products (AVX-512 VNNI / AVX-VNNI), several times the throughput under batch and in
  prefill, answers within perplexity but not token for token.

The sources are ``edge_engine/csrc/*.cpp`` (package data).  ``build()`` compiles them with
torch's ``cpp_extension`` (a C++ compiler, ninja, Python's headers) into
``build_directory()`` under torch's extension root (``TORCH_EXTENSIONS_DIR``, else
``~/.cache/torch_extensions``); ``edgegw build-kernels``, ``make install`` and the container
build call it.  The build is portable: one copy of the kernels per instruction set
(generic, AVX2, AVX-VNNI, AVX-512 VNNI), the best one this CPU has picked when the module
loads (``EDGE_ENGINE_ISA`` may name a lower one).  Loading (``status()``, ``available()``)
never compiles: an engine without a build runs float32 (``auto``) or refuses to start
(``int4``), saying why.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "GROUP",
    "MAX_ROWS",
    "KernelBuildError",
    "KernelStatus",
    "SOURCES",
    "available",
    "build",
    "build_directory",
    "pack_q4",
    "pack_q8",
    "q4_decoder",
    "q4_linear",
    "q4_tiles",
    "q8_linear",
    "q8_tiles",
    "status",
    "unpack_q4",
    "unpack_q4_tiles",
    "unpack_q8",
    "unpack_q8_tiles",
]

logger = logging.getLogger("edge_engine")

GROUP = 32  # inputs per scale (llama.cpp's QK4_1 = QK8_0 = 32)
TILE = 16  # output rows per tile
MAX_ROWS = 256  # rows the fused decoder takes in one step (decode rows: max_num_seqs)
_STALE_LOCK_S = 600  # a build lock older than this was left by a build that died

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("kernels.cpp", "dispatch.cpp", "isa_generic.cpp", "isa_avx2.cpp", "isa_avxvnni.cpp", "isa_avx512.cpp")
HEADERS = ("ops.h", "ops_impl.h")
_CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno"]  # -fopenmp: at::parallel_for runs on torch's OpenMP threads
_LDFLAGS = ["-fopenmp"]


class KernelBuildError(RuntimeError):
    """The kernels could not be compiled; the message says why and what to install."""


@dataclass(frozen=True, slots=True)
class KernelStatus:
    available: bool
    isa: str | None  # the instruction set the kernels run on ("avx512_vnni", "avx2", ...)
    reason: str  # why they are not available ("" when they are), or a note on the choice
    path: str  # the build directory

    def describe(self) -> str:
        if self.available:
            return f"{self.isa}" + (f" ({self.reason})" if self.reason else "")
        return self.reason


def _source_key() -> str:
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    for part in (torch.__version__, platform.python_version(), platform.machine(), *_CFLAGS):
        h.update(part.encode())
    return h.hexdigest()[:12]


def _extension_root() -> str:
    # torch's own rule: TORCH_EXTENSIONS_DIR, else $XDG_CACHE_HOME/torch_extensions, else
    # ~/.cache/torch_extensions (cpp_extension.get_default_build_root)
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return os.path.realpath(env)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.realpath(os.path.join(cache, "torch_extensions"))


def build_directory() -> str:
    """Where these sources, for this torch and Python, are compiled (and looked for)."""
    return os.path.join(_extension_root(), f"edge_engine_kernels_{_source_key()}")


def _library(build_dir: str) -> str:
    return os.path.join(build_dir, os.path.basename(build_dir) + ".so")


def _missing_tools() -> str | None:
    """What the build needs that this machine lacks, with what to install; None if nothing."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return (
            f"no C++ compiler ({compiler!r} is not on PATH): install one, e.g. `apt install g++` "
            "(Debian/Ubuntu), `dnf install gcc-c++` (Fedora/RHEL) or `apk add g++` (Alpine), then run "
            "`edgegw build-kernels`"
        )
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja is not installed: `pip install ninja` (or `apt install ninja-build`), then run `edgegw build-kernels`"
    include = sysconfig.get_paths().get("include") or ""
    if not os.path.isfile(os.path.join(include, "Python.h")):
        return f"Python's headers are missing ({include}/Python.h): `apt install python3-dev`, then run `edgegw build-kernels`"
    return None


def build(verbose: bool = False) -> str:
    """Compile the kernels for this machine (about a minute on 2 cores; nothing to do when
    the build is up to date) and return the build directory; raises ``KernelBuildError``
    saying why and what to install."""
    build_dir = build_directory()
    missing = _missing_tools()
    if missing is not None:
        raise KernelBuildError(f"the edge engine's kernels cannot be built: {missing}")
    from torch.utils import cpp_extension  # the build needs it; loading a build does not

    os.makedirs(build_dir, exist_ok=True)
    # a build killed half-way leaves torch's lock behind, and every later build would wait
    # on it for ever: a lock older than any real build is stale
    lock = os.path.join(build_dir, "lock")
    if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > _STALE_LOCK_S:
        logger.warning("edge_engine: removing a stale kernel build lock %s", lock)
        os.remove(lock)
    try:
        cpp_extension.load(
            name=os.path.basename(build_dir),
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cflags=_CFLAGS,
            extra_ldflags=_LDFLAGS,
            extra_include_paths=[str(CSRC)],
            build_directory=build_dir,
            verbose=verbose,
        )
    except Exception as exc:  # the compiler's own error, in many forms
        raise KernelBuildError(f"the edge engine's kernels did not compile in {build_dir}: {exc}") from exc
    _module.cache_clear()
    return build_dir


@functools.cache
def _module():
    """(the loaded module or None, why not).  Loads a finished build; never compiles."""
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return None, f"no kernels for this CPU architecture ({platform.machine()})"
    build_dir = build_directory()
    path = _library(build_dir)
    if not os.path.isfile(path):
        missing = _missing_tools()
        why = f"the edge engine's kernels are not built for this installation (no {path}): run `edgegw build-kernels`"
        return None, why + (f"; it needs {missing}" if missing else "")
    try:
        spec = importlib.util.spec_from_file_location(os.path.basename(build_dir), path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as exc:
        return None, f"the edge engine's kernels in {path} do not load: {exc}; rebuild them with `edgegw build-kernels`"
    return module, ""


def status() -> KernelStatus:
    """Whether the kernels are built and load here, and which instruction set they use."""
    module, why = _module()
    if module is None:
        return KernelStatus(False, None, why, build_directory())
    info = module.isa_info()
    return KernelStatus(True, info["isa"], info["note"], build_directory())


def available() -> bool:
    """Whether a build of the kernels loads here (never compiles)."""
    return _module()[0] is not None


def _loaded():
    module, why = _module()
    if module is None:
        raise KernelBuildError(why)
    return module


# -- the calls --------------------------------------------------------------------------------
def q4_linear(x: torch.Tensor, tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor], n: int, a8: bool = False) -> torch.Tensor:
    # x: [M, K] float32; tiles: q4_tiles(...) of an [n, K] weight -> [M, n] float32
    return _loaded().q4_linear(x, *tiles, n, a8)


def q8_linear(x: torch.Tensor, tiles: tuple[torch.Tensor, torch.Tensor], n: int, a8: bool = False) -> torch.Tensor:
    # x: [M, K] float32; tiles: q8_tiles(...) of an [n, K] weight -> [M, n] float32
    return _loaded().q8_linear(x, *tiles, n, a8)


def q4_decoder(params: list[torch.Tensor], num_heads: int, num_kv_heads: int, head_dim: int, eps: float, a8: bool = False):
    """A ``Q4Decoder`` over the layers' weights: 14 tensors per layer, in order attention
    norm, wqkv (tiles, scales, mins), wo (3), ffn norm, w13 (3), w2 (3).  Its
    ``forward(x, rope_rows, k_caches, v_caches, slots, tables, lens)`` runs a decode step's
    rows (up to ``MAX_ROWS``) through every layer in one call."""
    return _loaded().Q4Decoder(params, num_heads, num_kv_heads, head_dim, eps, a8)


# -- grids ------------------------------------------------------------------------------------
def pack_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q [N, K] uint8 in 0..15, scales [N, K/32] fp16, mins [N, K/32] fp16).

    Q4_1's rule: a group's min at q = 0 and its max at q = 15 (``scale = (max - min) / 15``),
    both stored in fp16 -- so a weight that came from a Q4_1 file is recovered exactly.
    """
    w = weight.float()
    N, K = w.shape
    assert K % GROUP == 0, f"in_features {K} is not a multiple of {GROUP}"
    groups = w.view(N, K // GROUP, GROUP)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, G]
    scales = ((hi - lo) / 15).half()
    mins = lo.half()
    step = scales.float().clamp(min=torch.finfo(torch.float16).tiny).unsqueeze(-1)
    q = torch.round((groups - mins.float().unsqueeze(-1)) / step).clamp_(0, 15).to(torch.uint8)  # [N, G, 32]
    return q.view(N, K), scales, mins


def unpack_q4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] a Q4 triple stands for (plain torch)."""
    N, K = q.shape
    groups = q.view(N, -1, GROUP).float()
    return torch.addcmul(mins.float().unsqueeze(-1), groups, scales.float().unsqueeze(-1)).view(N, K)


def pack_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q [N, K] int8, scales [N, K/32] fp16); Q8_0's rule ``scale = absmax /
    127``, so a weight from a Q8_0 file is recovered exactly."""
    w = weight.float()
    N, K = w.shape
    assert K % GROUP == 0, f"in_features {K} is not a multiple of {GROUP}"
    groups = w.view(N, K // GROUP, GROUP)
    scales = (groups.abs().amax(dim=-1) / 127).half()  # [N, G]
    step = scales.float().clamp(min=torch.finfo(torch.float16).tiny).unsqueeze(-1)
    q = torch.round(groups / step).clamp_(-127, 127).to(torch.int8)
    return q.view(N, K).contiguous(), scales


def unpack_q8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] a Q8 pair stands for."""
    N, K = q.shape
    return (q.view(N, -1, GROUP).float() * scales.float().unsqueeze(-1)).view(N, K)


# -- tile layouts (csrc/ops.h) ----------------------------------------------------------------
def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _tile_scales(s: torch.Tensor, T: int) -> torch.Tensor:
    # [N, G] -> [T, G, 16]
    return _pad_rows(s, T * TILE).view(T, TILE, -1).transpose(1, 2).contiguous()


def q4_tiles(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pack_q4``'s triple in tiles of 16 rows: ([T, G, 256] uint8, [T, G, 16] fp16 x 2)."""
    N, K = q.shape
    T, G = -(-N // TILE), K // GROUP
    t = _pad_rows(q, T * TILE).view(T, TILE, G, 4, 2, 4)  # [T, n, g, c, h, j]: k = 32 g + 8 c + 4 h + j
    t = t.permute(0, 2, 3, 1, 5, 4)  # [T, g, c, n, j, h]
    packed = (t[..., 0] | (t[..., 1] << 4)).reshape(T, G, 256).contiguous()
    return packed, _tile_scales(scales, T), _tile_scales(mins, T)


def unpack_q4_tiles(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, n: int) -> torch.Tensor:
    """The float32 weight [n, K] a tiled Q4 triple stands for."""
    T, G, _ = packed.shape
    b = packed.view(T, G, 4, TILE, 4)  # [T, g, c, n, j]
    q = torch.stack([b & 15, b >> 4], dim=-1)  # [T, g, c, n, j, h]
    q = q.permute(0, 3, 1, 2, 5, 4).reshape(T * TILE, G * GROUP)  # [n, k]
    s = scales.transpose(1, 2).reshape(T * TILE, G)
    m = mins.transpose(1, 2).reshape(T * TILE, G)
    return unpack_q4(q, s, m)[:n]


def q8_tiles(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_q8``'s pair in tiles of 16 rows: ([T, G, 512] uint8 holding q + 128, [T, G, 16] fp16)."""
    N, K = q.shape
    T, G = -(-N // TILE), K // GROUP
    biased = (q.to(torch.int16) + 128).to(torch.uint8)
    if N < T * TILE:  # padded rows hold q = 0
        biased = torch.cat([biased, biased.new_full((T * TILE - N, K), 128)])
    t = biased.view(T, TILE, G, 8, 4)  # [T, n, g, c, j]: k = 32 g + 4 c + j
    packed = t.permute(0, 2, 3, 1, 4).reshape(T, G, 512).contiguous()
    return packed, _tile_scales(scales, T)


def unpack_q8_tiles(packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """The float32 weight [n, K] a tiled Q8 pair stands for."""
    T, G, _ = packed.shape
    b = packed.view(T, G, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(T * TILE, G * GROUP)
    q = (b.to(torch.int16) - 128).to(torch.int8)
    return unpack_q8(q, scales.transpose(1, 2).reshape(T * TILE, G))[:n]
