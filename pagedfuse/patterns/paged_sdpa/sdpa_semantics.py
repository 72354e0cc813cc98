"""What this torch's SDPA does where the op's contract is silent: asked of SDPA itself, once
per device and dtypes, so the rewrite agrees with the version it runs on."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import unset_fake_temporarily


@functools.cache
def fully_masked_rows(device: torch.device, dtype: torch.dtype, mask_dtype: torch.dtype,
                      head_dim: int = 64) -> str:
    """What SDPA gives a query row whose every key is masked: "zeros" (what the op gives),
    "NaN" or "other values". Asked with a tiny call on ``device`` (real tensors, outside any
    fake mode): a bool mask of False, or a float mask of -inf."""
    with unset_fake_temporarily(), torch.no_grad():
        q = torch.ones(1, 1, 2, head_dim, dtype=dtype, device=device)
        kv = torch.ones(1, 1, 4, head_dim, dtype=dtype, device=device)
        keep = torch.tensor([[True] * 4, [False] * 4], device=device)
        mask = keep if mask_dtype == torch.bool else \
            torch.zeros(keep.shape, dtype=mask_dtype, device=device).masked_fill(~keep, -torch.inf)
        row = F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask)[0, 0, 1]
    if bool(torch.isnan(row).any()):
        return "NaN"
    return "zeros" if bool((row == 0).all()) else "other values"
