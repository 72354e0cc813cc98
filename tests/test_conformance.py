"""Every registered kernel backend against the float64 reference on one grid of calls
(helpers/conformance.py), on the CPU and on CUDA (marked ``cuda``: skipped without a GPU).
Backend-specific behaviour (instruction sets, split counts, launch plans) is tested in each
backend's own file."""

from __future__ import annotations

import pytest
from helpers.conformance import GRID, run_case

from pagedfuse.ops.backends import all_backends, get_backend, reason


def _params() -> list:
    params = []
    for backend in all_backends():
        for device in [backend.device] if backend.device else ["cpu", "cuda"]:
            marks = [pytest.mark.cuda] if device == "cuda" else []
            params.append(pytest.param((backend.name, device), id=f"{backend.name}-{device}",
                                       marks=marks))
    return params


@pytest.fixture(params=_params())
def backend_on(request):
    """(backend, device type) for every registered backend and each device it runs on."""
    name, device = request.param
    return get_backend(name), device


@pytest.mark.parametrize("grid_case", GRID, ids=[c.name for c in GRID])
def test_backend_matches_the_reference(backend_on, grid_case, monkeypatch):
    backend, device = backend_on
    why = run_case(backend, grid_case, device, monkeypatch)
    if why is not None:
        pytest.skip(f"{backend.name} does not take this call: {why}")


def test_each_backend_takes_part_of_the_grid(backend_on):
    """A backend whose supports() declined every case would pass the grid by skipping it
    (what it takes is run by test_backend_matches_the_reference)."""
    backend, device = backend_on

    def why(grid_case) -> str | None:
        case = grid_case.build(device)
        return reason(backend, case.call(**grid_case.hint_args(case), capability=False))

    assert any(why(c) is None for c in GRID), f"{backend.name} took none of the grid's cases"
