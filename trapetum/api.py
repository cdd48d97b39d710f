"""Python API.

    import trapetum
    m = trapetum.load()                       # embedded default (SmolLM2-135M-Instruct)
    m = trapetum.load("model.gguf")           # or a HF directory, or a .cbk file
    print(m.generate("The capital of France is", max_new_tokens=16).text)
    for ev in m.chat_stream([{"role": "user", "content": "Hi"}]):
        print(ev.text, end="", flush=True)
"""
from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import torch

from .errors import FormatError, TrapetumError, UnsupportedError
from .formats.detect import default_model_path, load_checkpoint
from .models.checkpoint import Checkpoint
from .models.decoder import Decoder
from .runtime.generate import Completion, ReferenceRunner, StreamEvent, stream_tokens
from .runtime.sampling import GenerationSettings

__all__ = ["load", "load_checkpoint", "Model", "GenerationSettings", "Completion", "StreamEvent",
           "default_model_path"]


ENGINE_MAX_LEN = 8192  # KV cache positions the GPU engine allocates (at most the model's context)


def default_dtype(ckpt: Checkpoint, device: str) -> torch.dtype:
    """fp32 on the CPU; fp16 on CUDA, where the engine runs (its kernels are fp16). The torch
    reference path on CUDA (TRAPETUM_ENGINE=reference) runs Gemma in bf16, whose activations
    can overflow fp16."""
    if device == "cpu":
        return torch.float32
    if os.environ.get("TRAPETUM_ENGINE", "gpu") == "reference" and ckpt.config.family.startswith("gemma"):
        return torch.bfloat16
    return torch.float16


class Model:
    """A loaded model: tokenizer + decoder + a runner; not thread-safe (one generation at a time)."""

    def __init__(self, ckpt: Checkpoint, device: str = "cpu", dtype: torch.dtype | None = None,
                 max_context: int | None = None, precise_prefill: bool | None = None, keep_reference: bool = False):
        from .runtime.precise import precise_enabled
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise UnsupportedError("--device cuda: no CUDA GPU is available on this machine")
        if device not in ("cpu",) and not device.startswith("cuda"):
            raise UnsupportedError(f"device {device!r} is not supported (cpu, cuda)")
        self.checkpoint = ckpt
        self.config = ckpt.config
        self.tokenizer = ckpt.tokenizer
        self.path = ckpt.source
        self.name = Path(ckpt.source).name
        self.device = device
        # precise prefill (GPU engine; the CPU path is fp32 already): the decoder stays in fp32, so that
        # the engine reads the source's exact dequantized weights (runtime/precise.py)
        self.precise_prefill = precise_enabled(precise_prefill) and device.startswith("cuda")
        self.dtype = dtype or (torch.float32 if self.precise_prefill else default_dtype(ckpt, device))
        self.context_size = min(self.config.max_position_embeddings, max_context or 1 << 30)
        if device.startswith("cuda"):
            self.context_size = min(self.context_size, ENGINE_MAX_LEN)
        self.decoder = Decoder.from_checkpoint(ckpt, dtype=self.dtype, device=device).eval()
        # on CUDA the engine takes over the codes it keeps in its own layouts (tiled / interleaved /
        # packed) unless keep_reference: the reference decoder then refuses forward() (logits() uses the engine)
        self.keep_reference = keep_reference
        self.runner = self._runner()

    def _runner(self):
        """The GPU engine on CUDA (TRAPETUM_ENGINE=reference keeps the torch reference path)."""
        if self.device.startswith("cuda") and os.environ.get("TRAPETUM_ENGINE", "gpu") != "reference":
            from .runtime.engine import GpuEngine
            return GpuEngine(self.decoder, max_len=min(self.context_size, ENGINE_MAX_LEN),
                             precise_prefill=self.precise_prefill, own_weights=not self.keep_reference)
        return ReferenceRunner(self.decoder)

    # -- prompts ---------------------------------------------------------------------------
    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise TrapetumError(f"{self.path}: this model has no tokenizer; pass token ids instead of text")
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        return self._need_tokenizer().encode(text)

    def count_tokens(self, prompt: str) -> int:
        return len(self.encode(prompt))

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self._need_tokenizer().encode_chat(messages, add_generation_prompt=True)

    # -- generation ------------------------------------------------------------------------
    @staticmethod
    def _settings(settings: GenerationSettings | None, overrides: dict[str, Any]) -> GenerationSettings:
        s = GenerationSettings(**vars(settings)) if settings is not None else GenerationSettings()
        for k, v in overrides.items():
            if not hasattr(s, k):
                raise TrapetumError(f"unknown generation setting {k!r}")
            setattr(s, k, v)
        return s.validate()

    def stream(self, prompt: str | list[int], settings: GenerationSettings | None = None, *,
               cancel: threading.Event | None = None, **overrides: Any) -> Iterator[StreamEvent]:
        """Yield StreamEvents (text pieces); the last one has done=True and .completion."""
        s = self._settings(settings, overrides)
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return stream_tokens(self.runner, self.tokenizer, ids, s, self.context_size, cancel)

    def generate(self, prompt: str | list[int], settings: GenerationSettings | None = None,
                 **overrides: Any) -> Completion:
        for ev in self.stream(prompt, settings, **overrides):
            if ev.done:
                return ev.completion
        raise AssertionError("stream ended without a completion")

    def chat_stream(self, messages: list[dict[str, Any]], settings: GenerationSettings | None = None, *,
                    cancel: threading.Event | None = None, **overrides: Any) -> Iterator[StreamEvent]:
        return self.stream(self.encode_chat(messages), settings, cancel=cancel, **overrides)

    def chat(self, messages: list[dict[str, Any]], settings: GenerationSettings | None = None,
             **overrides: Any) -> Completion:
        return self.generate(self.encode_chat(messages), settings, **overrides)

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Prompt logits [T, V] (float32) in one prefill (the GPU engine's once it owns the codes)."""
        if self.decoder.released is not None:
            return self.runner.logits_for(ids).float().cpu()
        t = torch.tensor([ids], dtype=torch.long, device=self.device)
        return self.decoder(t)[0].float().cpu()

    # -- description -----------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        info = describe(self.checkpoint, self.decoder)
        if self.decoder.released is not None:  # the engine's copies replaced the decoder's codes
            info["memory_loaded_weights_bytes"] = self.runner.weight_bytes()
        return info


def describe(ckpt: Checkpoint, decoder: Decoder | None = None) -> dict[str, Any]:
    cfg = ckpt.config
    from .models.checkpoint import expected_shapes
    n_params = 0
    for name, shp in expected_shapes(cfg).items():
        n = 1
        for d in shp:
            n *= d
        n_params += n
    formats = Counter(ckpt.tensor_formats().values())
    weight_bytes = None
    if decoder is not None:
        seen = set()
        weight_bytes = 0
        for t in list(decoder.parameters()) + list(decoder.buffers()):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                weight_bytes += t.numel() * t.element_size()
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    info = {
        "source": ckpt.source, "format": ckpt.source_format, "family": cfg.family,
        "parameters": n_params, "layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "heads": f"{cfg.num_heads} q / {cfg.num_kv_heads} kv x {cfg.head_dim}",
        "vocab_size": cfg.vocab_size, "context": cfg.max_position_embeddings,
        "tensor_formats": dict(formats),
        "memory_fp16_weights_bytes": 2 * n_params,
        "kv_cache_fp16_bytes_per_token": 2 * kv_per_token,
    }
    if weight_bytes is not None:
        info["memory_loaded_weights_bytes"] = weight_bytes
    if ckpt.meta:
        info["meta"] = {k: v for k, v in ckpt.meta.items() if k in ("recipe", "provenance", "sizes")}
    return info


def load(path: str | os.PathLike | None = None, device: str = "cpu", dtype: torch.dtype | None = None,
         max_context: int | None = None, precise_prefill: bool | None = None, keep_reference: bool = False) -> Model:
    """Load a model for generation. ``path``: HF directory, .gguf, .cbk, or None for the embedded default.

    ``precise_prefill`` (GPU engine; default: TRAPETUM_PREFILL, else off): prompt passes at the CPU fp32
    reference's accuracy (prompt logits ~1e-5 from it instead of ~1e-3), for evaluation and perplexity;
    2-3x the prefill GEMM work, and the decoder is kept in fp32 (more memory for dense sources).
    Decode steps are unchanged.

    ``keep_reference`` (CUDA): keep the reference decoder usable. By default the GPU engine takes over
    the codes it stores in its own kernel layouts (the decoder's copies are freed, so a model's codes
    are held once), and ``Model.logits`` runs on the engine."""
    return Model(load_checkpoint(path), device=device, dtype=dtype, max_context=max_context,
                 precise_prefill=precise_prefill, keep_reference=keep_reference)
