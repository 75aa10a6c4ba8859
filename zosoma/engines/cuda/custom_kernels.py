"""The CUDA engine's kernel launchers (as thinc keeps its raw kernels in _custom_kernels.py beside
cupy_ops.py): the kernels' signatures, read from kernels/*.cu, the runtime that compiles and
launches them, and device arrays. Every launch goes through `launch` (studies/gpu_check.py counts
them there; tests/test_kernels.py swaps in a runtime of the same kernels compiled for the CPU).

Kernels are compiled on first use with cupy.RawModule (NVRTC; CuPy caches the binaries on disk).
Their argument types are read from the .cu sources (`kernel_signatures`), and every launch is
checked against them, so a Python scalar is always passed at the width the kernel declares.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from zosoma.engines.cuda import backend

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
KERNEL_FILES = ("noise.cu", "lstm.cu", "fused.cu", "route.cu", "activity.cu")
BLOCK = 256  # threads per block of the kernels launched by `launch`


# --- kernel signatures: the one place Python learns the kernels' argument types ------------------

_SCALAR_TYPES = {"float": np.float32, "double": np.float64, "int": np.int32,
                 "unsigned int": np.uint32, "long long": np.int64, "unsigned long long": np.uint64}
_POINTER_TYPES = {"float": np.float32, "double": np.float64, "int": np.int32,
                  "unsigned int": np.uint32, "unsigned char": np.uint8}
_KERNEL_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)', re.S)


@dataclass(frozen=True)
class Param:
    """One kernel parameter: its name, C base type, and whether it is a pointer."""
    name: str
    ctype: str
    pointer: bool

    @property
    def dtype(self) -> np.dtype:
        table = _POINTER_TYPES if self.pointer else _SCALAR_TYPES
        return np.dtype(table[self.ctype])


def kernel_signatures(source: str) -> dict[str, tuple[Param, ...]]:
    """The parameters of every `extern "C" __global__` kernel in CUDA source text."""
    source = re.sub(r"//[^\n]*|/\*.*?\*/", " ", source, flags=re.S)
    kernels = {}
    for name, params in _KERNEL_RE.findall(source):
        parsed = []
        for text in params.split(","):
            words = text.replace("*", " * ").split()
            pointer = "*" in words
            words = [w for w in words if w not in ("*", "const", "__restrict__")]
            ctype = " ".join(words[:-1])
            if ctype not in (_POINTER_TYPES if pointer else _SCALAR_TYPES):
                raise ValueError(f"kernel {name}: unsupported parameter type in {text.strip()!r}")
            parsed.append(Param(words[-1], ctype, pointer))
        kernels[name] = tuple(parsed)
    return kernels


@lru_cache(maxsize=None)
def _signatures() -> dict[str, tuple[str, tuple[Param, ...]]]:
    """kernel name -> (its .cu file, its parameters), over every shipped kernel file."""
    found = {}
    for file in KERNEL_FILES:
        for name, params in kernel_signatures((KERNEL_DIR / file).read_text()).items():
            found[name] = (file, params)
    return found


# --- the runtime: where arrays live and how kernels are launched ---------------------------------

class CupyRuntime:
    """CuPy arrays and kernels compiled from kernels/*.cu with cupy.RawModule, one module per file,
    compiled on first use. (tests/test_kernels.py swaps in a runtime of NumPy arrays and the same
    kernels compiled for the CPU, to run this module without a GPU.)"""

    max_grid = (1 << 16, 65535)  # blocks along x and y; the kernels' grid-stride loops do the rest
    max_threads = 1024  # threads per block

    def __init__(self):
        self.xp = backend.require_cupy()
        # shared memory one block may use once it opts in (227 KB on an H100/H200, 163 KB on an A100)
        self.max_shared = int(self.xp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])
        self._modules = {}  # file -> cupy.RawModule
        self._kernels = {}  # name -> its function in the module

    def launch(self, file: str, name: str, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        kernel = self._kernels.get(name)
        if kernel is None:
            if file not in self._modules:  # a file may #include another kernel file beside it
                self._modules[file] = self.xp.RawModule(code=(KERNEL_DIR / file).read_text(),
                                                        options=(f"--include-path={KERNEL_DIR}",))
            kernel = self._kernels[name] = self._modules[file].get_function(name)
        if shared_mem > kernel.max_dynamic_shared_size_bytes:  # above 48 KB a kernel must opt in
            kernel.max_dynamic_shared_size_bytes = shared_mem
        kernel(grid, block, args, shared_mem=shared_mem)

    # the forward's other device work, here so that a graph capture (and the emulated runtime) sees it
    def gemm(self, a, b, out=None):
        """a @ b (batched: one cuBLAS strided-batched GEMM), into out when given."""
        return self.xp.matmul(a, b, out=out)

    def contiguous(self, x):
        """A C-contiguous copy of the view x."""
        return self.xp.ascontiguousarray(x)

    def zeros(self, shape, dtype=np.float32):
        return self.xp.zeros(shape, dtype)

    def capture(self, fn):
        """fn's device work captured once as a CUDA graph: a Graph whose replay() runs it again on
        the current stream and whose `outputs` are what fn returned. fn first runs once eagerly on
        the capture stream, which loads its kernels, sizes cuBLAS's workspace and fills the
        graph's own memory pool, so the capture allocates nothing new; the pool lives as long as
        the graph, so nothing else reuses the memory its nodes write."""
        cp = self.xp
        pool, stream = cp.cuda.MemoryPool(), cp.cuda.Stream(non_blocking=True)
        cp.cuda.Device().synchronize()  # the inputs fn reads were written on another stream
        with cp.cuda.using_allocator(pool.malloc), stream:
            fn()
            stream.synchronize()
            stream.begin_capture()
            try:
                outputs = fn()
            finally:
                graph = stream.end_capture()
        return _CudaGraph(graph, pool, outputs)


class _CudaGraph:
    """A captured cupy.cuda.Graph, the memory pool its nodes write into, and fn's outputs."""

    def __init__(self, graph, pool, outputs):
        self.graph, self.pool, self.outputs = graph, pool, outputs

    def replay(self):
        self.graph.launch()  # on the current stream: ordered with the work before and after it


_runtime = None


@contextlib.contextmanager
def using(rt):
    """`rt` as the active runtime inside the block (a recording runtime counts a step's launches:
    zosoma.engines.cuda.launches)."""
    global _runtime
    before, _runtime = _runtime, rt
    try:
        yield rt
    finally:
        _runtime = before


def runtime():
    """The active runtime, created on first use (raises ConfigError without a CUDA device)."""
    global _runtime
    if _runtime is None:
        _runtime = CupyRuntime()
    return _runtime


def launch(name: str, work: int, *args, rows: int = 1) -> None:
    """Launch kernel `name` over `work` items along x (and `rows` along y) with BLOCK threads per
    block, checking the arguments against the kernel's signature: arrays for pointers (of the
    pointee's dtype), scalars converted to the declared type."""
    rt = runtime()
    file, converted = _arguments(rt, name, args)
    grid = (max(1, min(-(-work // BLOCK), rt.max_grid[0])), max(1, min(rows, rt.max_grid[1])), 1)
    rt.launch(file, name, grid, (BLOCK, 1, 1), converted)


def launch_blocks(name: str, blocks: int, threads: int, shared_bytes: int, *args) -> None:
    """Launch a kernel that works block by block (barriers, shared memory): `blocks` blocks along x
    (capped at the runtime's grid; the kernel loops over the rest), `threads` per block (capped at
    the runtime's maximum; the kernel loops over its items) and shared_bytes of dynamic shared
    memory, the arguments checked as `launch` checks them."""
    rt = runtime()
    file, converted = _arguments(rt, name, args)
    if shared_bytes > rt.max_shared:
        raise ValueError(f"{name} needs {shared_bytes:,} B of shared memory per block, the device allows "
                         f"{rt.max_shared:,}")
    grid = (max(1, min(blocks, rt.max_grid[0])), 1, 1)
    rt.launch(file, name, grid, (max(1, min(threads, rt.max_threads)), 1, 1), converted, shared_mem=shared_bytes)


def _arguments(rt, name: str, args: tuple) -> tuple[str, tuple]:
    """(the kernel's file, args checked against its signature and converted to its types)."""
    file, params = _signatures()[name]
    if len(args) != len(params):
        raise TypeError(f"{name} takes {len(params)} arguments, got {len(args)}")
    converted = []
    for p, a in zip(params, args):
        if p.pointer:
            if not isinstance(a, rt.xp.ndarray) or a.dtype != p.dtype:
                raise TypeError(f"{name}: {p.name} must be a {p.dtype} {rt.xp.__name__} array, got {a!r:.60}")
            converted.append(a)
        else:
            converted.append(p.dtype.type(a))
    return file, tuple(converted)


def to_device(x, dtype=np.float32):
    """x as a C-contiguous device array of dtype (copied only when needed): keep weights that are
    used again on the device, so that calls do not copy them each time."""
    xp = runtime().xp
    return xp.ascontiguousarray(xp.asarray(x), dtype=dtype)


def check_out(out, shape: tuple, name: str = "out"):
    xp = runtime().xp
    if not isinstance(out, xp.ndarray) or out.dtype != np.float32 or out.shape != shape \
            or not out.flags.c_contiguous:
        want = "(n,)" if shape == (None,) else str(shape)
        raise ValueError(f"{name} must be a C-contiguous float32 {xp.__name__} array of shape {want}")
    return out
