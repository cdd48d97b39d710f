"""Python API.

    import trapetum
    m = trapetum.load()                       # embedded default (SmolLM2-135M-Instruct)
    m = trapetum.load("model.gguf")           # or a HF directory, or a .cbk file
    print(m.generate("The capital of France is", max_new_tokens=16).text)
    for ev in m.chat_stream([{"role": "user", "content": "Hi"}]):
        print(ev.text, end="", flush=True)
"""
from __future__ import annotations

import math
import os
import threading
from pathlib import Path
from typing import Any, Iterator

import torch

from .errors import FormatError, TrapetumError, UnsupportedError
from .formats.detect import default_model_path, load_checkpoint
from .models.checkpoint import Checkpoint
from .models.decoder import Decoder
from .models.describe import describe
from .models.families import overflows_fp16
from .runtime.generate import Completion, ReferenceRunner, StreamEvent, stream_tokens
from .runtime.sampling import GenerationSettings
from .settings import Options

__all__ = ["load", "load_checkpoint", "Model", "GenerationSettings", "Completion", "StreamEvent",
           "default_model_path", "Options"]


ENGINE_MAX_LEN = 8192  # KV cache positions the GPU engine allocates (at most the model's context)
DEFAULT_MAX_BATCH = 16  # requests decoded together (batch_scheduler; trapetum serve --max-batch)
DEFAULT_KV_GIB = 1.0    # the batch scheduler's paged KV cache, at most (--kv-mem / --kv-blocks choose)
KV_BLOCK = 16           # positions per KV block
PREFILL_CHUNK = 128     # prompt positions per prefill chunk (chunk boundaries at multiples of it)


def default_dtype(ckpt: Checkpoint, device: str, options: Options) -> torch.dtype:
    """fp32 on the CPU; fp16 on CUDA, where the engine runs (its kernels are fp16). The torch reference path on
    CUDA (Options.engine = "reference") runs families whose activations overflow fp16 in bf16."""
    if device == "cpu":
        return torch.float32
    if options.engine == "reference" and overflows_fp16(ckpt.config):
        return torch.bfloat16
    return torch.float16


class Model:
    """A loaded model: tokenizer + a runner (the GPU engine on CUDA, the reference decoder otherwise); not
    thread-safe (one generation at a time).

    ``options`` (default: ``Options.from_env()``, the TRAPETUM_* switches) choose the engine's kernels and modes;
    ``precise_prefill`` overrides ``options.prefill`` (True: "precise", False: "default")."""

    def __init__(self, ckpt: Checkpoint, device: str = "cpu", dtype: torch.dtype | None = None,
                 max_context: int | None = None, precise_prefill: bool | None = None, options: Options | None = None,
                 draft: Any = None, draft_k: int = 4, draft_adaptive: bool = False,
                 draft_mask_token: int | None = None, threads: int | None = None, sparsity: Any = None,
                 gpu_mem: float | None = None):
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise UnsupportedError("--device cuda: no CUDA GPU is available on this machine")
        if device not in ("cpu",) and not device.startswith("cuda"):
            raise UnsupportedError(f"device {device!r} is not supported (cpu, cuda)")
        options = options or Options.from_env()
        if precise_prefill is not None:
            options = options.replace(prefill="precise" if precise_prefill else "default")
        if gpu_mem is not None:
            if not device.startswith("cuda"):
                raise TrapetumError("--gpu-mem: a GPU memory budget applies to the GPU engine (--device cuda)")
            if not gpu_mem > 0:
                raise TrapetumError(f"--gpu-mem: the budget must be a positive number of GB, got {gpu_mem!r}")
            options = options.replace(gpu_mem_gb=float(gpu_mem))
        self.options = options
        if threads is not None and threads < 1:
            raise TrapetumError(f"threads must be at least 1, got {threads}")
        self.threads = threads  # the CPU's host kernels (None: torch.get_num_threads() at each call)
        self.checkpoint = ckpt
        self.config = ckpt.config
        self.tokenizer = ckpt.tokenizer
        self.path = ckpt.source
        self.name = Path(ckpt.source).name
        self.device = device
        self.sparsity = resolve_sparsity(ckpt, sparsity)  # SparsityTable or None (dense)
        on_engine = device.startswith("cuda") and options.engine == "gpu"
        # the precise prefill belongs to the GPU engine (the CPU reference is fp32 already)
        self.precise_prefill = on_engine and options.prefill == "precise"
        self.dtype = dtype or default_dtype(ckpt, device, options)
        self.context_size = min(self.config.context_length, max_context or 1 << 30)
        if device.startswith("cuda"):
            self.context_size = min(self.context_size, ENGINE_MAX_LEN)
        self._decoder = None
        if on_engine:
            from .runtime.engine import GpuEngine
            self.runner = GpuEngine(ckpt, self.context_size, device=device, options=options, sparsity=self.sparsity)
        else:
            self.runner = ReferenceRunner(self.decoder)
        self.speculative = None  # the speculative Runner when a drafter was given (runtime/speculative)
        self.draft_model = None
        if draft is not None:
            self._attach_draft(draft, draft_k, draft_adaptive, draft_mask_token)

    def _attach_draft(self, draft: Any, k: int, adaptive: bool, mask_token: int | None) -> None:
        """``draft``: "ngram" | "pard:MODEL" | a model path (runtime/speculative/factory.py), a Drafter, or a loaded
        Model (a draft model). The target side is this model's runner (engine or reference decoder)."""
        from .runtime.speculative import DraftModelDrafter, make_drafter, model_rows, speculative_runner
        from .runtime.speculative.factory import check_tokenizers, drafter_rows
        from .runtime.speculative.loop import check_k
        try:
            check_k(k)
        except ValueError as e:
            raise TrapetumError(str(e)) from None
        if draft is self:
            raise TrapetumError("draft: the draft model must be a separate model (it keeps its own KV cache)")
        if isinstance(draft, Model):
            check_tokenizers(self.tokenizer, draft.tokenizer, draft.path)
            drafter, dm = DraftModelDrafter(drafter_rows(draft, self.context_size), label=draft.name), draft
        else:
            def load_draft(path: str) -> Model:
                return Model(load_checkpoint(path), device=self.device, max_context=self.context_size,
                             options=self.options.replace(gpu_mem_gb=None), threads=self.threads)
            drafter, dm = make_drafter(draft, load=load_draft, target_tokenizer=self.tokenizer,
                                       max_len=self.context_size, mask_token=mask_token)
        self.draft_model = dm
        target = model_rows(engine=self.engine, decoder=None if self.engine is not None else self.decoder,
                            max_len=self.context_size)
        self.speculative = speculative_runner(target, drafter, k, adaptive)

    @property
    def engine(self):
        """The GPU engine, or None on the reference path."""
        return None if isinstance(self.runner, ReferenceRunner) else self.runner

    @property
    def decoder(self) -> Decoder:
        """The torch reference decoder (built on first use when the GPU engine runs the model: a second copy
        of the weights, for checks and tools). On the CPU its 4/8-bit codebook projections and a GGUF's legacy
        block-quantized ones (schemes/ggml.py) run the host GEMV (``Options.host_kernels``; ``threads``), without
        dense copies."""
        if self._decoder is None:
            host = self.device == "cpu" and self.options.host_kernels
            # on the CPU a GGUF's legacy block-quantized projections stay as stored, read by the host GEMV
            blocks = host and self.dtype == torch.float32 and self.checkpoint.source_format == "gguf"
            if blocks:
                from .kernels import ggml_host
                blocks = ggml_host.available()
            dec = Decoder.from_checkpoint(self.checkpoint, dtype=self.dtype, device=self.device,
                                          blocks=blocks).eval()
            if host:
                dec.use_host_kernels(self.threads, step=self.options.cpu_step, numerics=self.options.host_numerics)
            dec.set_sparsity(self.sparsity)
            self._decoder = dec
        return self._decoder

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
               cancel: threading.Event | None = None, speculative: bool = True,
               **overrides: Any) -> Iterator[StreamEvent]:
        """Yield StreamEvents (text pieces); the last one has done=True and .completion. With a drafter (``draft=``)
        the tokens come from the speculative runner (the same tokens as plain greedy decoding; sampled ones from
        the same distribution), a verify round's tokens back to back; ``speculative=False`` decodes plainly
        (the compare view). ``self.speculative.stats``: the last speculative generation's rounds and acceptance."""
        s = self._settings(settings, overrides)
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        runner = self.speculative if (speculative and self.speculative is not None) else self.runner
        return stream_tokens(runner, self.tokenizer, ids, s, self.context_size, cancel)

    def generate(self, prompt: str | list[int], settings: GenerationSettings | None = None, *,
                 speculative: bool = True, **overrides: Any) -> Completion:
        for ev in self.stream(prompt, settings, speculative=speculative, **overrides):
            if ev.done:
                return ev.completion
        raise AssertionError("stream ended without a completion")

    def chat_stream(self, messages: list[dict[str, Any]], settings: GenerationSettings | None = None, *,
                    cancel: threading.Event | None = None, speculative: bool = True,
                    **overrides: Any) -> Iterator[StreamEvent]:
        return self.stream(self.encode_chat(messages), settings, cancel=cancel, speculative=speculative, **overrides)

    def chat(self, messages: list[dict[str, Any]], settings: GenerationSettings | None = None, *,
             speculative: bool = True, **overrides: Any) -> Completion:
        return self.generate(self.encode_chat(messages), settings, speculative=speculative, **overrides)

    # -- batched generation (runtime/scheduler.py) ----------------------------------------------
    def batch_scheduler(self, max_batch: int = DEFAULT_MAX_BATCH, kv_blocks: int | None = None,
                        kv_mem: float | None = None, block_size: int = KV_BLOCK, chunk: int = PREFILL_CHUNK,
                        on_full: str = "queue", gpu: bool = False, prefill_budget: int | None = None,
                        fold: int | None = None, overlap: bool | None = None):
        """A Scheduler (continuous batching over a paged KV cache, runtime/scheduler.py): up to ``max_batch``
        requests decoded together, each producing exactly the tokens it produces alone. The cache: ``kv_blocks``
        blocks of ``block_size`` positions, or ``kv_mem`` GiB of them (default: room for max_batch full contexts,
        at most DEFAULT_KV_GIB on the CPU, at most half the free GPU memory on the engine). On the CPU over the reference decoder (runtime/paged_ops.py); on the GPU engine
        only with ``gpu=True`` (runtime/paged_engine.py: its GPU tests still to be run; else
        UnsupportedError). ``prefill_budget``: prompt positions prefilled per step, a forward counting as at least
        ``chunk`` (default one chunk: one prefill forward per step). ``fold``: prompts of at most this many tokens
        go into the decode forward as rows, up to ``prefill_budget`` rows a step (default the runner's: 128 on the
        GPU engine, 0 on the CPU; runtime/scheduler.py). ``overlap``: enqueue each decode step before the host
        handles the previous step's tokens (the same tokens, events a step later; default off: opt-in until
        measured on a GPU; runtime/scheduler.py). A drafter (``draft=``) is not used by batched
        decoding."""
        from .runtime.paged_kv import PagedKV
        from .runtime.scheduler import Scheduler
        if self.engine is None and self.device != "cpu":
            raise UnsupportedError("batched decoding: the torch reference path on CUDA is not batched")
        if self.engine is not None and not gpu:
            raise UnsupportedError("batched decoding on the GPU engine is experimental: pass gpu=True "
                                   "(trapetum serve --gpu-batch)")
        if kv_blocks is not None and kv_mem is not None:
            raise TrapetumError("give kv_blocks or kv_mem, not both")
        dtype = torch.float16 if self.engine is not None else self.dtype
        per = PagedKV.bytes_per_block(self.config, block_size, dtype)
        if kv_blocks is None:
            full = per * math.ceil(self.context_size / block_size) * max_batch
            if kv_mem is not None:
                nbytes = kv_mem * 2 ** 30
            elif self.engine is not None:  # on the GPU: at most half of the memory left free after the weights
                nbytes = min(full, torch.cuda.mem_get_info(self.engine.device)[0] // 2)
            else:
                nbytes = min(DEFAULT_KV_GIB * 2 ** 30, full)
            kv_blocks = int(nbytes // per)
            if kv_blocks < 1:
                raise TrapetumError(f"kv_mem {kv_mem} GiB holds no KV block ({per} bytes each)")
        if self.engine is not None:
            from .runtime.paged_engine import GpuBatchRunner
            runner = GpuBatchRunner(self.engine, kv_blocks, block_size)
        else:
            from .runtime.paged_ops import CpuBatchRunner
            runner = CpuBatchRunner(self.decoder, PagedKV(self.config, kv_blocks, block_size, dtype, self.device))
        return Scheduler(runner, self.tokenizer, self.config.vocab_size, self.context_size, max_batch=max_batch,
                         chunk=chunk, prefill_budget=prefill_budget, on_full=on_full, device=self.device,
                         fold=fold, overlap=overlap)

    def generate_batch(self, prompts: list, settings: GenerationSettings | list | None = None, *,
                       max_batch: int | None = None, kv_blocks: int | None = None, kv_mem: float | None = None,
                       gpu: bool = False, **overrides: Any) -> list[Completion]:
        """Completions of many prompts (text or token ids), decoded together (``batch_scheduler``); ``settings``:
        one for all or one per prompt (``overrides`` apply to each). Each completion is exactly what the prompt
        gives alone through the scheduler. On the GPU engine without ``gpu=True`` the prompts run one after
        another (the same completions as ``generate``, without the batch speed-up)."""
        per = settings if isinstance(settings, list) else [settings] * len(prompts)
        if len(per) != len(prompts):
            raise TrapetumError(f"settings: {len(per)} for {len(prompts)} prompts")
        sets = [self._settings(s, overrides) for s in per]
        ids = [self.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        if self.engine is not None and not gpu:
            return [self.generate(i, s, speculative=False) for i, s in zip(ids, sets)]
        sched = self.batch_scheduler(max_batch or max(1, min(len(prompts), 64)), kv_blocks, kv_mem, gpu=gpu)
        reqs = [sched.submit(i, s) for i, s in zip(ids, sets)]
        sched.run()
        return [r.completion for r in reqs]

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Prompt logits [T, V] (float32) in one prefill (the GPU engine's on CUDA)."""
        if self.engine is not None:
            return self.engine.logits_for(ids).float().cpu()
        t = torch.tensor([ids], dtype=torch.long, device=self.device)
        return self.decoder(t)[0].float().cpu()

    # -- description -----------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        if self.engine is not None:
            info = describe(self.checkpoint)
            info["memory_loaded_weights_bytes"] = self.engine.weight_bytes()
            return info
        return describe(self.checkpoint, self.decoder)


def resolve_sparsity(ckpt: Checkpoint, sparsity: Any):
    """The activation-sparsity table ``sparsity`` names (models/sparsity.py): None / "off" (dense), "on" (the
    thresholds in the .cbk's ``sparsity`` section), a side file's path, or a SparsityTable."""
    from .models.sparsity import SparsityTable, check_sparse_kinds, read_side_file

    if sparsity is None or sparsity is False or sparsity == "off":
        return None
    check_sparse_kinds(ckpt.config)
    n = ckpt.config.num_layers
    if isinstance(sparsity, SparsityTable):
        sparsity.check_model(n, ckpt.source)
        return sparsity
    if sparsity == "on":
        meta = ckpt.meta or {}
        if meta.get("sparsity") is not None:
            return meta["sparsity"]
        if meta.get("sparsity_version") is not None:
            raise FormatError(f"{ckpt.source}: its sparsity section has version {meta['sparsity_version']}; this "
                              "build reads version 1")
        raise TrapetumError(f"{ckpt.source}: --sparsity on: the model has no sparsity section (run trapetum sparsify "
                            "MODEL --calib FILE --sparsity S, or pass a side file)")
    if not isinstance(sparsity, (str, os.PathLike)):
        raise TrapetumError(f"sparsity must be 'on', 'off', a file or a SparsityTable, got {type(sparsity).__name__}")
    return read_side_file(sparsity, n)


def load(path: str | os.PathLike | None = None, device: str = "cpu", dtype: torch.dtype | None = None,
         max_context: int | None = None, precise_prefill: bool | None = None, options: Options | None = None,
         draft: Any = None, draft_k: int = 4, draft_adaptive: bool = False,
         draft_mask_token: int | None = None, threads: int | None = None, sparsity: Any = None,
         gpu_mem: float | None = None) -> Model:
    """Load a model for generation. ``path``: HF directory, .gguf, .cbk, or None for the embedded default.

    On CUDA the GPU engine is built from the checkpoint tensor by tensor (its weights held once, in the kernels'
    layouts); ``options`` (default ``Options.from_env()``) pick its kernels and modes (trapetum/settings.py).
    ``precise_prefill`` (GPU engine; default: ``options.prefill``): prompt passes at the CPU fp32 reference's
    accuracy (prompt logits ~1e-5 from it instead of ~1e-3), for evaluation and perplexity; 2-3x the prefill
    GEMM work. Decode steps are unchanged.

    ``draft`` (exact speculative decoding, runtime/speculative): "ngram" (n-gram lookup), "pard:MODEL" (a PARD
    drafter; ``draft_mask_token`` when its config names no ``pard_token``), a model path with the target's
    tokenizer (e.g. a 2- or 3-bit .cbk of the same checkpoint), a loaded Model, or a Drafter; ``draft_k`` drafts
    per verify round (1..15), ``draft_adaptive`` lets it move. The drafter runs on the same device.

    ``threads``: threads of the CPU's host kernels (4/8-bit codebook projections; None: ``torch.get_num_threads()``
    at each call, which the CLI's ``--threads`` sets).

    ``sparsity`` (activation sparsity, TEAL; models/sparsity.py): None (dense, the default: the dense path, bit for
    bit), "on" (the thresholds of a .cbk's ``sparsity`` section, ``trapetum sparsify``), a side file of
    thresholds (GGUF / HF models), or a SparsityTable. The drafter of speculative decoding stays dense.

    ``gpu_mem`` (GPU engine): a GPU memory budget in GB (``Options.gpu_mem_gb``; runtime/placement.py): the
    embedding table, then the routed experts of a mixture-of-experts model, move to host RAM until the rest and the
    KV cache fit (the experts then run on the CPU's host kernels); a model that does not fit even so is refused in
    one line. None (default): everything on the GPU."""
    return Model(load_checkpoint(path), device=device, dtype=dtype, max_context=max_context,
                 precise_prefill=precise_prefill, options=options, draft=draft, draft_k=draft_k,
                 draft_adaptive=draft_adaptive, draft_mask_token=draft_mask_token, threads=threads,
                 sparsity=sparsity, gpu_mem=gpu_mem)
