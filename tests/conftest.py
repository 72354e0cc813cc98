"""Shared fixtures; GPU tests are marked `cuda` and skipped without a GPU."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and pagedfuse's reports emptied before and after the test, so every
    compile in it starts from a fresh trace (and its report is the only one)."""
    import pagedfuse

    torch._dynamo.reset()
    pagedfuse.clear_reports()
    yield
    torch._dynamo.reset()
