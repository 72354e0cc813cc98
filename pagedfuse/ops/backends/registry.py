"""The kernel-backend registry: which kernel runs a paged-attention call, and why not others.

A backend declares its device, a priority, the ops and head dims it is built for, and
``supports(call)``, which returns why it cannot take a call (None: it can). The op asks the
backends of the call's device in priority order and runs the first that takes the call. A
device with no backend of its own is served by the any-device backends (the pure-torch
reference); a device that has backends never falls back to the reference silently: a call
none of them takes is an error that names each one's reason. ``PAGEDFUSE_BACKEND=name``
forces one backend.

``supports`` may read only what ``check_metadata`` reads (shapes, strides, dtypes, devices)
plus the call's ``causal`` and hints, never tensor values or pointers (check_metadata has
checked the alignment of every pointer already), so the op caches its choice per call
signature. Under a fake trace the sizes may be SymInts: a backend must not branch on one
(that would add a guard); it declines with a reason instead.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import torch

from pagedfuse import envs
from pagedfuse.ops.call import PagedCall
from pagedfuse.ops.reference import quantize_int8_reference
from pagedfuse.ops.signature_cache import SignatureCache

Tensor = torch.Tensor
Supports = Callable[[PagedCall], "str | None"]
Run = Callable[[PagedCall, Tensor, object], None]
Quantize = Callable[[Tensor], "tuple[Tensor, Tensor]"]


def _takes_all(call: PagedCall) -> str | None:
    return None


@dataclass(frozen=True, eq=False)
class Backend:
    """One kernel family.

    ``device``: the device type it runs on, or None for any device that has no backend of its
    own. ``priority``: higher is asked first. ``head_dims``: the ops it serves, each with the
    head dims it is built for (None: any). ``supports``: why it cannot take a call whose op
    and head_dim it serves (None: it can). ``run(call, out, plan)`` fills the contiguous
    ``out`` [T, Hq, D]; ``plan`` None means the backend's own choice for the call, otherwise a
    backend-specific launch plan (how benchmarks pin tile shapes and split counts).
    ``make_plan(call, **overrides)``: the plan ``run`` would choose, with the overrides it
    names (a backend with launch choices). ``quantize``: its quantize_int8 kernel, if any.
    ``host_launch(call)`` / ``host_quantize(x)``: the launch spec the C++ host path
    (csrc/host/host.cpp) keeps for the signature of a call ``run`` / ``quantize`` served, or
    None to leave such calls to Python; a backend without them always runs in Python.
    ``defers(call)``: why the op's own choice asks the next backend first for a call this one
    can run (a measured speed rule, from metadata only), or None to take it; a backend named
    by PAGEDFUSE_BACKEND runs every call it supports.
    """

    name: str
    device: str | None
    priority: int
    head_dims: Mapping[str, Collection[int] | None]
    run: Run
    supports: Supports = _takes_all
    make_plan: Callable[..., object] | None = None
    quantize: Quantize | None = None
    host_launch: Callable[[PagedCall], dict | None] | None = None
    host_quantize: Callable[[torch.Tensor], dict | None] | None = None
    defers: Supports | None = None


_BACKENDS: dict[str, Backend] = {}
# The op's choice per (geometry, causal, hints, forced name): the geometry stands for the call
# signature (see Geometry). Cleared whenever a backend comes or goes.
_CHOICES: SignatureCache[tuple, Backend] = SignatureCache()
_QUANTIZE: dict[str, Quantize] = {}  # quantize_int8's kernel per device type
generation = 0  # bumped on every registry change; validate's verdict cache keys on it
_LISTENERS: list[Callable[[], None]] = []


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener`` after every registry change: caches of choices made through the
    registry outside this module (the C++ host path's signature table) forget them."""
    _LISTENERS.append(listener)


def _changed() -> None:
    global generation
    generation += 1
    _CHOICES.clear()
    _QUANTIZE.clear()
    for listener in _LISTENERS:
        listener()


def register_backend(backend: Backend) -> Backend:
    """Add ``backend`` (its name must be new); returns it."""
    if backend.name in _BACKENDS:
        raise ValueError(f"a backend named {backend.name!r} is already registered")
    _BACKENDS[backend.name] = backend
    _changed()
    return backend


def unregister_backend(name: str) -> Backend:
    """Remove the backend ``name`` (tests that register a temporary one); returns it."""
    backend = _BACKENDS.pop(name)
    _changed()
    return backend


def get_backend(name: str) -> Backend:
    try:
        return _BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(_BACKENDS))
        raise ValueError(f"no kernel backend named {name!r} (registered: {known})") from None


def all_backends() -> list[Backend]:
    """Every registered backend, by device type, then priority (highest first)."""
    return sorted(_BACKENDS.values(), key=lambda b: (b.device or "", -b.priority, b.name))


def backends_for(device_type: str) -> list[Backend]:
    """The backends the op asks on ``device_type``, highest priority first: the device's
    own, or the any-device ones where it has none."""
    own = [b for b in _BACKENDS.values() if b.device == device_type]
    chosen = own or [b for b in _BACKENDS.values() if b.device is None]
    return sorted(chosen, key=lambda b: -b.priority)


def kernel_devices() -> frozenset[str]:
    """Device types with backends of their own (elsewhere only the slow reference runs)."""
    return frozenset(b.device for b in _BACKENDS.values() if b.device is not None)


def supported_head_dims(op: str, device_type: str) -> frozenset[int] | None:
    """The head dims some backend on ``device_type`` has a kernel of ``op`` for (None: any)."""
    dims: set[int] = set()
    for backend in backends_for(device_type):
        if op not in backend.head_dims:
            continue
        served = backend.head_dims[op]
        if served is None:
            return None
        dims.update(served)
    return frozenset(dims)


def head_dim_reason(op: str, device_type: str, head_dim: int) -> str | None:
    """None when some backend on ``device_type`` runs ``op`` at ``head_dim``, else why not."""
    dims = supported_head_dims(op, device_type)
    if dims is None or head_dim in dims:
        return None
    listed = ", ".join(str(d) for d in sorted(dims))
    return f"head_dim {head_dim} not in {{{listed}}} for {op} on {device_type}"


def reason(backend: Backend, call: PagedCall) -> str | None:
    """Why ``backend`` cannot take ``call`` (None: it can): device, op and head_dim from its
    declaration, then its own ``supports``."""
    device = call.device.type
    if backend.device not in (None, device):
        return f"runs on {backend.device}, not {device}"
    if call.op not in backend.head_dims:
        return f"no {call.op} kernel"
    dims, head_dim = backend.head_dims[call.op], call.geometry.head_dim
    if dims is not None:
        if not isinstance(head_dim, int):
            return "head_dim is dynamic"
        if head_dim not in dims:
            return f"head_dim {head_dim} not in {{{', '.join(map(str, sorted(dims)))}}}"
    return backend.supports(call)


def passed_over(backend: Backend, call: PagedCall) -> str | None:
    """Why the op's own choice does not take ``backend`` for ``call``: ``reason``, or what
    its ``defers`` says (None: it takes the call)."""
    why = reason(backend, call)
    if why is None and backend.defers is not None and (later := backend.defers(call)):
        return f"defers: {later}"
    return why


def _choose(call: PagedCall, forced: str | None) -> Backend:
    if forced is not None:
        backend = get_backend(forced)
        why = reason(backend, call)
        if why is not None:
            raise ValueError(f"PAGEDFUSE_BACKEND={forced} cannot run this call: {why}")
        return backend
    reasons = []
    for backend in backends_for(call.device.type):
        why = passed_over(backend, call)
        if why is None:
            return backend
        reasons.append(f"{backend.name}: {why}")
    raise ValueError(f"{call.op}: no kernel backend on {call.device.type} takes this call "
                     f"({'; '.join(reasons) or 'none registered'})")


def choose(call: PagedCall) -> Backend:
    """The backend that runs ``call``: PAGEDFUSE_BACKEND's, else the first of the device's
    that takes it. Cached per call signature, causal flag and hints."""
    forced = envs.PAGEDFUSE_BACKEND
    key = (call.geometry, call.causal, call.max_seq_len, call.max_query_len, forced)
    backend = _CHOICES.get(key)
    if backend is None:
        backend = _CHOICES.put(key, _choose(call, forced))
    return backend


def quantize_backend(device_type: str) -> Backend | None:
    """The backend whose quantize_int8 kernel runs on ``device_type``: the first of the device
    that brings one (None: the pure-torch reference runs)."""
    return next((b for b in backends_for(device_type) if b.quantize), None)


def quantize_kernel(device_type: str) -> Quantize:
    """quantize_int8's kernel on ``device_type``: quantize_backend's, else the pure-torch
    reference."""
    kernel = _QUANTIZE.get(device_type)
    if kernel is None:
        backend = quantize_backend(device_type)
        kernel = quantize_int8_reference if backend is None else backend.quantize
        _QUANTIZE[device_type] = kernel
    return kernel


@dataclass(frozen=True)
class SupportReport:
    """Which backend would run a call on its device and why each other one would not.

    ``reasons``: every backend asked, in the order the op asks them, with None for those
    that take the call; ``chosen``: the first of those (None: no backend takes it)."""

    device: str
    reasons: dict[str, str | None]

    @property
    def chosen(self) -> str | None:
        return next((name for name, why in self.reasons.items() if why is None), None)

    def __str__(self) -> str:
        declined = "; ".join(f"{n}: {why}" for n, why in self.reasons.items() if why)
        if self.chosen is None:
            return f"no backend on {self.device} takes this call: {declined or 'none registered'}"
        others = [n for n, why in self.reasons.items() if why is None and n != self.chosen]
        parts = [f"would run {self.chosen}", declined]
        if others:
            parts.append(f"{', '.join(others)}: ok")
        return "; ".join(p for p in parts if p)


def report_for(call: PagedCall) -> SupportReport:
    """The SupportReport of a call (real or fake tensors), ignoring PAGEDFUSE_BACKEND."""
    device = call.device.type
    return SupportReport(device, {b.name: passed_over(b, call) for b in backends_for(device)})
