"""Our CPU kernels, built for this machine on first use: the int4/int8 matrix products (`kernels/rows_mm.cpp`) and
the fused forward of a decoder stack (`kernels/fused_step.cpp`, models/fused.py), both on `kernels/quant_core.h`.

torch's weight-only CPU kernels dequantize the weights again for every tile of 4 activation rows, so scoring 5
tokens costs about twice 4 and a tree of 17 four times one token. Ours turn a block of codes into bfloat16 once
and multiply every row from it with AVX-512 bfloat16 dot products; the kernel comment states the arithmetic and
the invariant (a row's result does not depend on the other rows of the call).

They need a CPU with AVX512-BF16 and a C++ compiler. The first process to use them compiles them with
`torch.utils.cpp_extension` (about 30 s of CPU; a few minutes of a busy 2-core machine) into torch's extension
cache; later processes load the cached library. Where either is missing, or the build fails, quantized layers use
torch's kernels, and say so once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch
from torch import Tensor

from specsample.models.cpu import cpu_flags

log = logging.getLogger("specsample")

KERNELS = Path(__file__).parent / "kernels"
SOURCES = (KERNELS / "rows_mm.cpp", KERNELS / "fused_step.cpp")
HEADERS = (KERNELS / "quant_core.h", KERNELS / "pool.h")
FLAGS = [
    "-O3",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mavx512bf16",
    "-mfma",
    "-mamx-tile",
    "-mamx-bf16",
    "-fopenmp",
]
AMX_CPU_FLAGS = ("amx_tile", "amx_bf16")
STALE_LOCK_S = 20 * 60  # longer than any build of the kernels
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")

_state: dict[str, bool] = {}  # "loaded": the outcome of the one attempt this process makes


def cpu_supports() -> bool:
    """True when the CPU lists every instruction set the kernels are compiled for."""
    return set(REQUIRED_CPU_FLAGS) <= cpu_flags()


def can_build() -> bool:
    """Whether this machine can build (or has built) the kernels: the CPU's instructions and a C++ compiler."""
    return cpu_supports() and shutil.which(os.environ.get("CXX", "c++")) is not None


def available() -> bool:
    """Whether `torch.ops.specsample_rows` is loaded in this process (building it on the first call)."""
    if "loaded" not in _state:
        _state["loaded"] = _load()
    return _state["loaded"]


def _load() -> bool:
    if not cpu_supports():
        log.info("int4/int8 layers use torch's kernels: this CPU lacks AVX512-BF16")
        return False
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("int4/int8 layers use torch's slower kernels: no C++ compiler to build ours (install g++)")
        return False
    from torch.utils.cpp_extension import _get_build_directory, load

    name = f"specsample_kernels_{digest()}"
    _clear_stale_lock(Path(_get_build_directory(name, verbose=False)) / "lock")
    log.info("loading the int4/int8 CPU kernels (built once per machine: about 30 s of CPU)")
    try:
        load(
            name=name,
            sources=[str(source) for source in SOURCES],
            extra_include_paths=[str(KERNELS)],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as error:  # a failed build leaves torch's kernels, which compute the same products
        log.warning("int4/int8 layers use torch's slower kernels: building ours failed (%s)", error)
        return False
    _register_fakes()
    torch.ops.specsample_rows.start_pool(torch.get_num_threads())
    set_amx(True)
    log.info("int4 layers multiply on %s", "AMX tiles" if _state["amx"] else "AVX-512")
    return True


def _clear_stale_lock(lock: Path, poll: float = 1.0) -> None:
    """torch's build lock is a bare file that a killed build leaves behind, and every later process would wait on it
    forever: wait while another process builds (its lock younger than STALE_LOCK_S), then remove a lock that is still
    there."""
    logged = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_S:
            log.warning("removing %s, left %.0f min ago by a build that did not finish", lock, age / 60)
            lock.unlink(missing_ok=True)
            return
        if not logged:
            log.info("waiting for another process building the kernels (%s)", lock)
            logged = True
        time.sleep(poll)


def set_amx(on: bool) -> bool:
    """Run int4 products on AMX tiles (where the CPU has them and Linux grants them) or, with `on` False, on AVX-512;
    returns whether tiles are used. Loading picks tiles where it can; a model's rows keep their invariance only within
    one choice, so this is for tests and measurements that compare the two, before any model runs."""
    _state["amx"] = bool(torch.ops.specsample_rows.use_amx(on and set(AMX_CPU_FLAGS) <= cpu_flags()))
    return _state["amx"]


def uses_amx() -> bool:
    """Whether int4 products run on AMX tiles in this process."""
    return available() and _state["amx"]


def digest() -> str:
    """A hash of the kernels' sources and headers: the extension's name, so an edited header builds a new library
    (torch's extension cache tracks the sources alone) and checkouts of different kernels never share one."""
    hashed = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        hashed.update(path.read_bytes())
    return hashed.hexdigest()[:12]


def _register_fakes() -> None:
    """Shapes of the ops for torch.compile (the compiled decode step calls them as opaque kernels)."""

    def int4_fake(x: Tensor, packed: Tensor, group: int, scales_zeros: Tensor, pool: bool = False) -> Tensor:
        return x.new_empty(x.shape[0], packed.shape[0] * 64)

    def int8_fake(x: Tensor, codes: Tensor, scales: Tensor, pool: bool = False) -> Tensor:
        return x.new_empty(x.shape[0], codes.shape[0])

    torch.library.register_fake("specsample_rows::int4_rows_mm")(int4_fake)
    torch.library.register_fake("specsample_rows::int8_rows_mm")(int8_fake)


def int4_fits(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether an int4 weight has the shapes our kernel reads (models/quant.pack_int4_ours)."""
    return out_features % 64 == 0 and in_features % 32 == 0 and group_size % 32 == 0 and in_features % group_size == 0


def int8_fits(out_features: int, in_features: int) -> bool:
    """Whether an int8 weight has the shapes our kernel reads."""
    return out_features % 16 == 0 and in_features % 32 == 0
