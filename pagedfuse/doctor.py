"""What this machine's pagedfuse can run: versions, kernel libraries, missing fast paths, and
which kernel backend each op takes for a few typical calls (``pagedfuse doctor``).

A missing fast path is said out loud, never only degraded into: on import where a CUDA device
is visible but Triton or the CUDA C++ library is missing, and at the first compile on a GPU
the library has no code for (``warn_if_degraded``).
"""

from __future__ import annotations

import importlib.util
import platform
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedfuse import __version__
from pagedfuse.ops.backends import support_report
from pagedfuse.ops.backends.registry import SupportReport

# How to build the CUDA C++ library: under the Python that has the CUDA torch, without build
# isolation (an isolated build cannot import torch, so it cannot build CUDA code).
REINSTALL = "python -m pip install --no-build-isolation -e ."


class PagedfuseWarning(UserWarning):
    """A pagedfuse fast path is missing on this machine (see ``pagedfuse doctor``)."""


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _gpu_present() -> bool:
    """An NVIDIA GPU on this machine, whatever torch can see (a CPU-only torch sees none)."""
    return Path("/proc/driver/nvidia/gpus").is_dir() or shutil.which("nvidia-smi") is not None


def versions() -> dict[str, str]:
    """The versions and devices that decide which kernels run."""
    triton = "not installed"
    if _has_module("triton"):
        import triton

        triton = triton.__version__
    found = {
        "pagedfuse": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch CUDA": torch.version.cuda or "none (a CPU build of torch)",
        "triton": triton,
        "nvcc": shutil.which("nvcc") or "not on PATH",
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            found[f"cuda:{i}"] = f"{torch.cuda.get_device_name(i)} (sm_{major}{minor})"
    return found


@dataclass(frozen=True)
class Library:
    """One compiled kernel library and what this machine makes of it."""

    name: str
    what: str
    built: bool
    note: str


def libraries() -> list[Library]:
    from pagedfuse.ops import cpu, cuda_native

    cpu_built = _has_module("pagedfuse._C")
    cpu_note = (f"instruction sets {', '.join(cpu.available_isas())}; selected "
                f"{cpu.selected_isa()}" if cpu_built else
                "not built: the CPU runs the pure-torch reference (slow); run `make setup`")
    cuda_built = cuda_native.library() is not None
    if not cuda_built:
        cuda_note = f"needs nvcc and a CUDA torch at install ({REINSTALL})"
    elif not torch.cuda.is_available():
        cuda_note = "built; no CUDA device visible"
    else:
        runs = cuda_native.decode_available(torch.device("cuda"))
        cuda_note = ("runs on this GPU" if runs else
                     "built without code for this GPU: set PAGEDFUSE_CUDA_ARCH and reinstall")
    return [Library("pagedfuse._C", "CPU kernels (C++)", cpu_built, cpu_note),
            Library("pagedfuse._cuda_kernels", "CUDA C++ decode", cuda_built, cuda_note)]


def missing_fast_paths(check_arch: bool = True) -> list[str]:
    """Each fast path this machine should have and does not, with what to do about it.
    ``check_arch``: also ask the CUDA library whether it runs on the GPU (this initializes
    CUDA, so import-time checks leave it to the first compile)."""
    from pagedfuse.ops import cuda_native

    found = []
    if not _has_module("pagedfuse._C"):
        found.append("the CPU kernels (pagedfuse._C) are not built: CPU calls run the slow "
                     "pure-torch reference; run `make setup` or " + REINSTALL)
    cuda_visible = torch.cuda.is_available()
    if not cuda_visible:
        if _gpu_present() and torch.version.cuda is None:
            found.append(f"this machine has an NVIDIA GPU but torch {torch.__version__} is a "
                         "CPU build: no GPU kernel can run; install a CUDA build of torch")
        return found
    if not _has_module("triton"):
        found.append("Triton is not installed: CUDA calls run the slow pure-torch reference")
    if cuda_native.library() is None:
        why = "no nvcc on PATH at install" if shutil.which("nvcc") is None else \
            "built without it (e.g. pip's isolated build, which cannot import torch)"
        found.append(f"the CUDA C++ decode (pagedfuse._cuda_kernels) is not built ({why}): "
                     f"decode runs the slower Triton kernel; reinstall with {REINSTALL} "
                     "under the Python that has the CUDA torch")
    elif check_arch and not cuda_native.decode_available(torch.device("cuda")):
        major, minor = torch.cuda.get_device_capability()
        found.append(f"pagedfuse._cuda_kernels has no code for this GPU (sm_{major}{minor}): "
                     "decode runs the slower Triton kernel; reinstall with "
                     f"PAGEDFUSE_CUDA_ARCH={major}{minor} {REINSTALL}")
    return found


_warned: set[str] = set()


def warn_if_degraded(check_arch: bool = True) -> None:
    """Warn once per problem (PagedfuseWarning) about each missing fast path."""
    for problem in missing_fast_paths(check_arch):
        if problem not in _warned:
            _warned.add(problem)
            warnings.warn(f"pagedfuse: {problem} (details: `pagedfuse doctor`)",
                          PagedfuseWarning, stacklevel=2)


@dataclass(frozen=True)
class TypicalCall:
    """A call shape the doctor asks the backend registry about."""

    label: str
    op: str
    dtype: torch.dtype
    kv: str  # "float", "int8" (K and V) or "int8_k" (INT8 K, 16-bit V)
    head_dim: int
    q_len: int = 1
    q_heads: int = 32
    kv_heads: int = 8

    def report(self, device: str) -> SupportReport:
        """The registry's verdict on this call on ``device`` (small tensors, nothing run)."""
        batch, block_size, blocks = 2, 16, 4
        d = self.head_dim
        query = torch.randn(batch * self.q_len, self.q_heads, d, dtype=self.dtype,
                            device=device)
        shape = (batch * blocks, block_size, self.kv_heads, d)
        scales = {}
        if self.kv == "float":
            k = v = torch.randn(shape, dtype=self.dtype, device=device)
        else:
            k = torch.zeros(shape, dtype=torch.int8, device=device)
            v = k if self.kv == "int8" else torch.randn(shape, dtype=self.dtype, device=device)
            scale = torch.ones(shape[:3], device=device)
            scales = {"key_scale": scale, "value_scale": scale if self.kv == "int8" else None}
        table = torch.arange(batch * blocks, dtype=torch.int32, device=device).view(batch, -1)
        lens = torch.full((batch,), blocks * block_size, dtype=torch.int32, device=device)
        starts = torch.arange(batch + 1, dtype=torch.int32, device=device) * self.q_len
        return support_report(self.op, query, k, v, table, lens, starts, causal=True,
                              max_seq_len=blocks * block_size, max_query_len=self.q_len,
                              **scales)


TYPICAL_CALLS = (
    TypicalCall("decode bf16, head_dim 128, GQA 4", "paged_attention", torch.bfloat16,
                "float", 128),
    TypicalCall("decode INT8 K+V, head_dim 128", "paged_attention_int8", torch.bfloat16,
                "int8", 128),
    TypicalCall("decode INT8 K + bf16 V, head_dim 64", "paged_attention_int8", torch.bfloat16,
                "int8_k", 64),
    TypicalCall("prefill bf16, 16 query tokens, head_dim 128", "paged_attention",
                torch.bfloat16, "float", 128, q_len=16),
    TypicalCall("decode fp32, head_dim 128", "paged_attention", torch.float32, "float", 128),
    TypicalCall("decode bf16, head_dim 96", "paged_attention", torch.bfloat16, "float", 96),
)


def devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def report() -> str:
    """The whole doctor report as text."""
    lines = ["versions"]
    lines += [f"  {k:<11} {v}" for k, v in versions().items()]
    lines.append("kernel libraries")
    for lib in libraries():
        lines.append(f"  {lib.name:<24} {'built' if lib.built else 'not built':<9} "
                     f"{lib.what}: {lib.note}")
    problems = missing_fast_paths()
    lines.append("missing fast paths" + ("" if problems else ": none"))
    lines += [f"  ! {p}" for p in problems]
    for device in devices():
        lines.append(f"backend per typical call on {device}")
        for call in TYPICAL_CALLS:
            try:
                verdict = str(call.report(device))
            except (TypeError, ValueError) as exc:
                verdict = f"refused: {exc}"
            lines.append(f"  {call.label}: {verdict}")
    return "\n".join(lines)
