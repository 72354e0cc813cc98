"""Context managers that change the kernel-backend registry for one test."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from pagedfuse.ops.backends import Backend, backends_for, register_backend, unregister_backend


@contextlib.contextmanager
def registered(backend: Backend) -> Iterator[Backend]:
    """``backend`` registered for the duration."""
    register_backend(backend)
    try:
        yield backend
    finally:
        unregister_backend(backend.name)


@contextlib.contextmanager
def without_backends(device_type: str) -> Iterator[None]:
    """The device's own backends removed for the duration, so only the reference serves it
    (as on a device that has no kernels)."""
    removed = [unregister_backend(b.name) for b in backends_for(device_type)
               if b.device == device_type]
    try:
        yield
    finally:
        for backend in removed:
            register_backend(backend)
