"""Builds pagedfuse._C (C++ CPU kernels, pybind11), pagedfuse._host (the ops' dispatcher
kernels, linked with libtorch) and, where nvcc and a CUDA build of torch are present,
pagedfuse._cuda_kernels (CUDA C++ kernels with a C ABI, loaded with ctypes).

_C and _cuda_kernels do not link libtorch, so they serve every torch version; _host is built
against the torch this build imports (the package runs without it, on the Python path). The
build switches (PAGEDFUSE_CUDA, PAGEDFUSE_CUDA_ARCH, PAGEDFUSE_NVCC_FLAGS) are declared with
every other PAGEDFUSE_* variable in pagedfuse/envs.py, loaded here by path: the package itself
cannot be imported before it is built.
"""

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import warnings

from pybind11.setup_helpers import Pybind11Extension
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _load_envs():
    spec = importlib.util.spec_from_file_location(
        "pagedfuse_envs", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                       "pagedfuse", "envs.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


envs = _load_envs()


class NvccLibrary(Extension):
    """A shared library compiled and linked by nvcc alone (static cudart)."""


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidate = os.path.join(home, "bin", "nvcc") if home else None
    return candidate if candidate and os.path.exists(candidate) else shutil.which("nvcc")


class CudaLibraryWarning(UserWarning):
    """The CUDA C++ decode will not be built although this machine looks like it wants it."""


def _loud(message: str) -> None:
    """pip shows a build backend's warnings even under -q; the banner stands out in -v logs."""
    banner = "*" * 78
    print(f"{banner}\npagedfuse: {message}\n{banner}", file=sys.stderr, flush=True)
    warnings.warn(message, CudaLibraryWarning, stacklevel=2)


def _gpu_present() -> bool:
    """An NVIDIA GPU on this machine (its driver is loaded), whatever torch can see."""
    return os.path.isdir("/proc/driver/nvidia/gpus") or shutil.which("nvidia-smi") is not None


def _cuda_wanted() -> bool:
    """Whether to build the CUDA C++ library; says out loud when a machine with a GPU, nvcc or
    a CUDA torch ends up without it (pagedfuse then falls back to slower kernels)."""
    flag = envs.PAGEDFUSE_CUDA
    if flag in ("0", "1"):
        return flag == "1"
    nvcc, gpu = _nvcc(), _gpu_present()
    fix = ("build under the Python that has the CUDA torch: python -m pip install "
           "--no-build-isolation -e .")
    try:
        import torch
    except ImportError:
        if nvcc or gpu:
            _loud("torch cannot be imported by this build (pip's build isolation, or another "
                  f"Python than torch's), so the CUDA C++ decode is NOT built; {fix}")
        return False
    if torch.version.cuda is None:
        if gpu:
            _loud(f"torch {torch.__version__} is a CPU build on a machine with an NVIDIA GPU: "
                  "the CUDA C++ decode is NOT built and no GPU kernel will run; install a CUDA "
                  "build of torch, then reinstall pagedfuse")
        return False
    if nvcc is None:
        _loud("torch is a CUDA build but nvcc was not found (PATH, CUDA_HOME): the CUDA C++ "
              "decode is NOT built, decode runs the slower Triton kernel; install the CUDA "
              "toolkit or set CUDA_HOME, then reinstall")
        return False
    archs = [int(a) for a in envs.PAGEDFUSE_CUDA_ARCH.replace(",", ";").split(";")]
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        here = 10 * major + minor
        if here not in archs and not here > max(archs):  # PTX of the last serves newer GPUs
            _loud(f"this GPU is sm_{here}, but PAGEDFUSE_CUDA_ARCH={envs.PAGEDFUSE_CUDA_ARCH} "
                  "builds no code it runs: decode will run the slower Triton kernel; set "
                  f"PAGEDFUSE_CUDA_ARCH={here} (sm_80 or newer) and reinstall")
    return True


class BuildExt(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, NvccLibrary):
            super().build_extension(ext)
            return
        nvcc = _nvcc()
        if nvcc is None:
            raise RuntimeError("PAGEDFUSE_CUDA=1 but no nvcc (set CUDA_HOME or PATH)")
        archs = envs.PAGEDFUSE_CUDA_ARCH.replace(",", ";").split(";")
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
        gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        # --threads 0: the targets compile side by side (the two grids' 108 kernels per
        # target take about a minute each).
        cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-Xptxas", "-v",
               "--threads", "0",
               *shlex.split(envs.PAGEDFUSE_NVCC_FLAGS), *gencode,
               *ext.sources, "-o", target]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)


def _host_extension() -> Extension | None:
    """pagedfuse._host (csrc/host): the ops' Autograd, CPU and, with a CUDA torch, CUDA kernels
    in C++, so a call of a signature seen before does not enter Python. It links libtorch,
    hence builds against the torch imported here (none: not built; the ops then run their
    Python implementation). It calls the kernels of _C and _cuda_kernels through the
    addresses pagedfuse/ops hands it."""
    try:
        import torch
        from torch.utils.cpp_extension import CppExtension
    except ImportError:
        return None
    macros = [("TORCH_EXTENSION_NAME", "_host"), ("TORCH_API_INCLUDE_EXTENSION_H", None),
              ("_GLIBCXX_USE_CXX11_ABI", str(int(torch._C._GLIBCXX_USE_CXX11_ABI)))]
    if torch.version.cuda is not None:
        macros.append(("PAGEDFUSE_HOST_CUDA", "1"))
    return CppExtension("pagedfuse._host", sources=["csrc/host/host.cpp"],
                        include_dirs=["csrc"], define_macros=macros,
                        extra_compile_args=["-O3", "-std=c++20"])


extensions = [
    Pybind11Extension(
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
    ),
]
host = _host_extension()
if host is not None:
    extensions.append(host)
if _cuda_wanted():
    extensions.append(NvccLibrary("pagedfuse._cuda_kernels", sources=["csrc/cuda/paged_decode.cu"]))

setup(ext_modules=extensions, cmdclass={"build_ext": BuildExt})
