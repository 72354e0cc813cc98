"""Every PAGEDFUSE_* environment variable, declared once: name, default, meaning, reader.

Python code reads a switch as an attribute of this module (``envs.PAGEDFUSE_CHECKS``), which
gives the variable's current value on each access, so a test or a benchmark can change it
between calls (through os.environ, monkeypatch or ``overridden``). The eager ops read
switches on every call, so an access is a property of the module's class (no failed
attribute lookup) that reads os.environ's own store and parses only a value it has not seen.
Variables read by C++ or by setup.py are declared here too, so this is the one list of them;
setup.py loads this file by path (it imports nothing but the standard library), since the
package cannot be imported before it is built.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


def _flag(raw: str) -> bool:
    return raw == "1"


def _on_unless_zero(raw: str) -> bool:
    return raw != "0"


def _name_or_none(raw: str) -> str | None:
    return raw or None


def _text(raw: str) -> str:
    return raw


def _mebibytes(raw: str) -> int:
    """A budget in MiB: a whole number >= 0 (the one switch that takes a number)."""
    if not raw.strip().isdigit():
        raise ValueError(f"PAGEDFUSE_DEQUANT_SCRATCH_MB: a whole number of MiB >= 0, got "
                         f"{raw!r}")
    return int(raw)


@dataclass(frozen=True)
class EnvVar:
    """One switch: ``parse`` turns the raw string (the default when unset) into its value;
    ``reader`` says who reads it: "python" (through this module), "c++" (the CPU kernels,
    on every call) or "setup.py" (at build time)."""

    name: str
    default: str
    meaning: str
    reader: str
    parse: Callable[[str], Any] = _text

    def value(self) -> Any:
        return _reader(self)()


VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("PAGEDFUSE_CHECKS", "0",
           "1: check tensor values (block ids, lengths) of device tensors too, which "
           "synchronizes with the device; CPU tensors are always checked", "python", _flag),
    EnvVar("PAGEDFUSE_BACKEND", "",
           "force the named kernel backend (see pagedfuse.ops.backends) for every paged "
           "attention call; a call it cannot take raises, naming why", "python",
           _name_or_none),
    EnvVar("PAGEDFUSE_PDL", "1",
           "0: launch the CUDA kernels plainly instead of as programmatic dependent launches "
           "on sm_90 (e.g. for a profiler that serializes kernels)", "python", _on_unless_zero),
    EnvVar("PAGEDFUSE_BALANCED", "0",
           "1: the CUDA C++ decode takes its balanced grid rather than fixed splits (faster "
           "on a batch of one long sequence among short ones; see docs/cuda-decode.md)",
           "python", _flag),
    EnvVar("PAGEDFUSE_DEQUANT_SCRATCH_MB", "1024",
           "the most memory (MiB) an INT8 K+V prefill call may take for a copy of its pages "
           "with V dequantized, on which the Gluon INT8 K kernel runs faster than its INT8 K+V "
           "kernel (see docs/design.md); a call that needs more, and every call at 0, widens "
           "V inside the kernel", "python", _mebibytes),
    EnvVar("PAGEDFUSE_ASSUME_VISIBLE_KEY", "0",
           "1: the rewrite may assume every query row of a compiled program sees at least one "
           "key (true of a serving step, where each query sees itself): on a device whose SDPA "
           "gives a fully masked row other values than the op's zeros (CUDA), masked attention "
           "is fused only under this assumption (read when a graph compiles)", "python", _flag),
    EnvVar("PAGEDFUSE_CPU_ISA", "auto",
           "the CPU kernels' instruction set: auto, portable or avx512 (AVX-512 VNNI)", "c++"),
    EnvVar("PAGEDFUSE_CUDA", "auto",
           "1: build the CUDA C++ library (fails without nvcc); 0: skip it; auto: build it "
           "where nvcc and a CUDA build of torch are present", "setup.py"),
    EnvVar("PAGEDFUSE_CUDA_ARCH", "80;90",
           "compute capabilities to build the CUDA C++ library for (machine code for each, "
           "plus PTX of the last for newer GPUs)", "setup.py"),
    EnvVar("PAGEDFUSE_NVCC_FLAGS", "",
           "extra nvcc flags (e.g. a -D of a kernel variant to time)", "setup.py"),
)}


@contextlib.contextmanager
def overridden(name: str, value: str | None) -> Iterator[None]:
    """The switch ``name`` set to ``value`` inside the block (None: left as it is), then put
    back as it was (unset included): how tests and benchmarks force a backend or an ISA."""
    if name not in VARIABLES:
        raise ValueError(f"name: {name!r} is not a declared switch ({', '.join(VARIABLES)})")
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


# os.environ keeps its entries in a dict of encoded names and values, updated by every change
# made through os.environ: one lookup there replaces os.environ.get's encoding and, for an
# unset name, its raised and caught KeyError (together about 1 µs per read, several per call).
_STORE: Any = getattr(os.environ, "_data", None)
_READERS: dict[str, Callable[..., Any]] = {}


def _reader(var: EnvVar) -> Callable[..., Any]:
    """A function giving ``var``'s current value: the last parse while the raw value stays.
    It takes (and ignores) one optional argument, so that it serves as the property's
    getter itself, without a wrapper call per read."""
    found = _READERS.get(var.name)
    if found is not None:
        return found
    if _STORE is None or not hasattr(os.environ, "encodekey"):  # not CPython's os.environ
        def read(_module: object = None) -> Any:
            return var.parse(os.environ.get(var.name, var.default))
    else:
        key, unseen = os.environ.encodekey(var.name), object()
        seen: list[Any] = [unseen, None]  # the raw value last parsed, and its parse

        def read(_module: object = None) -> Any:
            raw = _STORE.get(key)
            if raw is not seen[0] and (raw is None or raw != seen[0]):
                text = var.default if raw is None else os.environ.decodevalue(raw)
                seen[:] = [raw, var.parse(text)]
            return seen[1]
    _READERS[var.name] = read
    return read


class _Module(types.ModuleType):
    """This module's class: one read-only property per declared switch."""


def _property(var: EnvVar) -> property:
    return property(_reader(var), doc=var.meaning)


for _var in VARIABLES.values():
    setattr(_Module, _var.name, _property(_var))
sys.modules[__name__].__class__ = _Module


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])
