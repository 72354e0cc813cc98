"""The eager host path of the CUDA C++ decode on any machine: the switches it reads on every
call follow os.environ at once, and the one launch call it makes (cuda_native.decode_into)
hands the library the right record, pointers and scratch. The library is a recording stand-in
here; the kernels themselves are tested on the GPU (test_cuda_kernels.py)."""

from __future__ import annotations

import ctypes
import math
import os

import pytest
import torch

from pagedfuse import envs
from pagedfuse.ops import cuda_native
from pagedfuse.ops.call import FLOAT_OP, INT8_OP, Geometry, PagedCall


def test_a_switch_follows_os_environ_at_once(monkeypatch):
    monkeypatch.delenv("PAGEDFUSE_PDL", raising=False)
    assert envs.PAGEDFUSE_PDL is True  # the default, "1"
    monkeypatch.setenv("PAGEDFUSE_PDL", "0")
    assert envs.PAGEDFUSE_PDL is False
    os.environ["PAGEDFUSE_PDL"] = "1"
    assert envs.PAGEDFUSE_PDL is True
    with envs.overridden("PAGEDFUSE_BALANCED", "1"):
        assert envs.PAGEDFUSE_BALANCED is True
    monkeypatch.setenv("PAGEDFUSE_BACKEND", "cpu")
    assert envs.PAGEDFUSE_BACKEND == "cpu" == envs.VARIABLES["PAGEDFUSE_BACKEND"].value()
    monkeypatch.delenv("PAGEDFUSE_BACKEND")
    assert envs.PAGEDFUSE_BACKEND is None
    with pytest.raises(AttributeError, match="PAGEDFUSE_NONESUCH"):
        envs.PAGEDFUSE_NONESUCH  # noqa: B018
    assert "PAGEDFUSE_PDL" in dir(envs)


class _Recorder:
    """Stands in for the library: records each fused launch's record and pointers."""

    def __init__(self):
        self.launches = []

    def pagedfuse_decode_fused(self, address, stream, *pointers):
        record = cuda_native.DecodeLaunch.from_address(address)
        self.launches.append((record, stream, pointers))
        return 0


@pytest.fixture
def recorder(monkeypatch):
    lib = _Recorder()
    monkeypatch.setattr(cuda_native, "library", lambda: lib)
    monkeypatch.setattr(cuda_native, "_index", lambda device: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1234,
                        raising=False)
    workspaces = []

    def workspace(index, stream, nbytes):
        workspaces.append((index, stream, nbytes))
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(cuda_native, "_workspace", workspace)
    lib.workspaces = workspaces
    return lib


def _call(kind: str, batch=3, hq=8, hkv=2, d=64, query=None, window=None, softcap=None):
    if query is None:
        query = torch.randn(batch, hq, d).to(torch.bfloat16)
    key = torch.randint(-127, 128, (6, 16, hkv, d), dtype=torch.int8) if kind != "half" \
        else torch.randn(6, 16, hkv, d).to(torch.bfloat16)
    value = torch.randn(6, 16, hkv, d).to(torch.bfloat16) if kind != "int8_kv" else \
        torch.randint(-127, 128, (6, 16, hkv, d), dtype=torch.int8)
    key_scale = torch.rand(6, 16, hkv) if kind != "half" else None
    value_scale = torch.rand(6, 16, hkv) if kind == "int8_kv" else None
    table = torch.randint(0, 6, (batch, 5), dtype=torch.int32)
    lens = torch.full((batch,), 70, dtype=torch.int64)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    geometry = Geometry(batch, hq, hkv, d, 6, 16, batch, 5)
    return PagedCall(INT8_OP if key_scale is not None else FLOAT_OP, query, key, value,
                     key_scale, value_scale, table, lens, starts, 0.125, True, None, None, 1,
                     geometry, window, softcap)


@pytest.mark.parametrize("kind", ["int8_kv", "int8_k", "half"])
@pytest.mark.parametrize("splits", [1, 5])
def test_one_launch_call_gets_the_record_pointers_and_scratch(recorder, kind, splits):
    call = _call(kind, window=40, softcap=30.0)
    out = torch.empty_like(call.query)
    pdl = cuda_native.PDL_AFTER_QUANTIZE if kind != "half" else cuda_native.PDL_WAIT_FIRST
    cuda_native.decode_into(call, out, splits, 2, pdl=pdl)
    cuda_native.decode_into(call, out, splits, 2, pdl=pdl)
    (first, stream, pointers), (again, _, _) = recorder.launches
    assert ctypes.addressof(first) == ctypes.addressof(again)  # built once per signature
    assert stream == 1234
    g, rows = call.geometry, 3 * 8
    quantize = kind != "half"
    assert (first.kind, first.out_dtype, first.pdl, first.head_dim, first.heads,
            first.quantize) == (cuda_native.KINDS.index(kind), 0, pdl, 64, 2, int(quantize))
    assert (first.batch, first.num_kv_heads, first.splits, first.ctas) == (3, 2, splits, 0)
    assert first.index64 == 0b010  # seq_lens alone is int64
    assert list(first.sizes) == [3, 8, 4, 6, 5, 16, 4, 40]
    k_strides = [s * call.key_cache.element_size() for s in call.key_cache.stride()[:3]]
    assert list(first.strides)[:4] == [call.query.stride(0), *k_strides]
    assert first.q_stride_h == call.query.stride(1)
    assert first.scale_log2 == pytest.approx(0.125 * math.log2(math.e))
    assert first.softcap == 30.0
    # scratch: splits' partial rows, then the int8 query and its scales, 16-byte aligned
    parts = rows * splits if splits > 1 else 0
    assert (first.part_o, first.part_lse) == (0, parts * g.head_dim * 4)
    assert first.q8 == parts * g.head_dim * 4 + -(-parts * 4 // 16) * 16
    assert first.q_scale == first.q8 + (rows * 64 if quantize else 0)
    used = first.q_scale + (rows * 4 if quantize else 0)
    assert [w[2] for w in recorder.workspaces] == ([-(-used // 16) * 16] * 2 if used else [])
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    expected = [ptr(t) for t in (call.query, call.key_cache, call.value_cache, call.key_scale,
                                 call.value_scale, call.block_table, call.seq_lens,
                                 call.query_start_loc, out)]
    assert list(pointers[:9]) == expected
    assert (pointers[9] is None) == (used == 0)
    assert pointers[10] is None  # counters: the balanced grid's only


def test_a_query_the_kernel_cannot_read_in_place_is_copied(recorder):
    wide = torch.randn(3, 8, 72).to(torch.bfloat16)[..., :64]  # heads 144 bytes apart
    call = _call("half", query=wide)
    cuda_native.decode_into(call, torch.empty(3, 8, 64, dtype=torch.bfloat16), 1, 1)
    record, _, pointers = recorder.launches[0]
    assert record.strides[0] == 8 * 64 and pointers[0] != wide.data_ptr()
    quantized = _call("int8_kv", query=wide)  # the quantize reads it with its strides
    cuda_native.decode_into(quantized, torch.empty(3, 8, 64, dtype=torch.bfloat16), 1, 1)
    record, _, pointers = recorder.launches[1]
    assert (record.strides[0], record.q_stride_h) == (8 * 72, 72)
    assert pointers[0] == wide.data_ptr()


def test_each_launch_choice_has_its_own_record(recorder):
    call = _call("int8_kv")
    out = torch.empty_like(call.query)
    for pdl in (cuda_native.PDL_OFF, cuda_native.PDL_AFTER_QUANTIZE):
        for splits in (1, 3):
            cuda_native.decode_into(call, out, splits, 1, pdl=pdl)
    assert [(r.pdl, r.splits) for r, _, _ in recorder.launches] == [(0, 1), (0, 3), (2, 1),
                                                                    (2, 3)]
