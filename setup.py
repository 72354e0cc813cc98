"""Builds pagedfuse._C: plain C++ over raw pointers, no libtorch link.

One build serves every torch version.
"""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

ext = Pybind11Extension(
    "pagedfuse._C",
    sources=[
        "csrc/bindings.cpp",
        "csrc/paged_attention.cpp",
        "csrc/attention_portable.cpp",
        "csrc/attention_avx512.cpp",
        "csrc/quantize.cpp",
    ],
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=fast"],
    extra_link_args=["-fopenmp"],
)

setup(ext_modules=[ext])
