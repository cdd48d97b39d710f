"""End to end on the three real GGUF models: Trapetum's decoder against transformers' GGUF-loaded
model (the independent reference), fp32 on the CPU.

- prompt logits: ||ours - ref|| / ||ref|| <= 1e-3 (all positions)
- 16 greedy tokens identical (EOS ignored, so all 16 are compared)

Weights on both sides are the GGUF's dequantized 4-bit-class tensors ("fp32" = dequantized source).
SmolLM2 runs in CI; Gemma-3 and Qwen2.5 are marked slow.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from real_models import hf_reference, require

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers needs it to load GGUF weights

PROMPTS = {
    "smollm2": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    "qwen25": [{"role": "user", "content": "Write a Python function that reverses a string."}],
    "gemma3": "The three primary colors are",  # its GGUF carries no chat template
}
N_NEW = 16
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"  # ../shared/data beside the repo


@torch.inference_mode()
def ref_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy continuation with transformers' KV cache (argument named ``cache`` in transformers >= 5.x,
    ``past_key_values`` before); EOS is not special here, as with ignore_eos on our side."""
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(torch.tensor([ids]), use_cache=True)
    new: list[int] = []
    for _ in range(n):
        new.append(int(out.logits[0, -1].argmax()))
        past = getattr(out, name, None)
        if past is None:
            past = out.past_key_values
        out = model(torch.tensor([new[-1:]]), use_cache=True, **{name: past})
    return new


def check_model(name: str) -> dict:
    import trapetum

    path = require(name)
    ours = trapetum.load(path)
    prompt = PROMPTS[name]
    ids = ours.encode_chat(prompt) if isinstance(prompt, list) else ours.encode(prompt)
    ref = hf_reference(name, "model")
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0].float()
    got = ours.logits(ids)
    assert got.shape == want.shape
    rel = float((got - want).norm() / want.norm())
    ref_tokens = ref_greedy(ref, ids, N_NEW)
    completion = ours.generate(ids, max_new_tokens=N_NEW, temperature=0.0, ignore_eos=True)
    same = sum(a == b for a, b in zip(completion.token_ids, ref_tokens))
    print(f"{name}: prompt {len(ids)} tokens, logits rel err {rel:.2e}, greedy {same}/{N_NEW} "
          f"ours={ours.tokenizer.decode(completion.token_ids)!r}")
    assert rel <= 1e-3, rel
    assert completion.token_ids == ref_tokens
    return {"rel": rel, "same": same}


def test_smollm2_logits_and_greedy():
    check_model("smollm2")


@pytest.mark.slow
def test_gemma3_logits_and_greedy():
    check_model("gemma3")


@pytest.mark.slow
def test_qwen25_logits_and_greedy():
    check_model("qwen25")


@pytest.mark.slow
def test_gemma3_long_prompt_past_sliding_window():
    """A prompt longer than Gemma-3's 512-token window: sliding layers must mask, global ones not."""
    import trapetum

    path = require("gemma3")
    if not (DATA / "tinyshakespeare" / "input.txt").is_file():
        pytest.skip(f"{DATA}/tinyshakespeare/input.txt is not there")
    text = open(DATA / "tinyshakespeare" / "input.txt", encoding="utf-8").read()[:4000]
    ours = trapetum.load(path)
    ids = ours.encode(text)[:700]
    assert len(ids) > 512 + 100
    ref = hf_reference("gemma3", "model")
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0].float()
    got = ours.logits(ids)
    rel = float((got - want).norm() / want.norm())
    tail = float((got[512:] - want[512:]).norm() / want[512:].norm())
    print(f"gemma3 long prompt: {len(ids)} tokens, logits rel err {rel:.2e} (positions >= 512: {tail:.2e})")
    assert rel <= 1e-3 and tail <= 1e-3
