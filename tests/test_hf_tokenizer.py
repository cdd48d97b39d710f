"""HF directory tokenizer + chat template agree with transformers; text in, text out through the CLI."""
import subprocess
import sys

import pytest

import trapetum
from tests.tiny_models import build

TEXTS = ["Hello world", "  spaces   and\ttabs\n\nnewlines", "ROMEO: But soft, what light?", "ünïcödé ✓ 🙂",
         "digits 1234567890 and <s> special </s>"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build("llama3", d, tokenizer=True)
    return d


def test_tokenizer_matches_transformers(model_dir):
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(model_dir)
    tok = trapetum.load(model_dir).tokenizer
    for t in TEXTS:
        assert tok.encode(t) == ref(t).input_ids
        assert tok.decode(tok.encode(t)) == ref.decode(ref(t).input_ids, skip_special_tokens=True)


def test_chat_template_matches_transformers(model_dir):
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(model_dir)
    tok = trapetum.load(model_dir).tokenizer
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    for agp in (True, False):
        assert tok.apply_chat_template(msgs, add_generation_prompt=agp) == ref.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=agp)
    assert tok.encode_chat(msgs) == list(ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True,
                                                                 return_dict=True)["input_ids"])


def test_stop_strings_and_streaming(model_dir):
    m = trapetum.load(model_dir)
    full = m.generate("ROMEO:", max_new_tokens=24, ignore_eos=True)
    assert full.completion_tokens == 24 and full.finish_reason == "length"
    pieces = [ev.text for ev in m.stream("ROMEO:", max_new_tokens=24, ignore_eos=True) if not ev.done]
    assert "".join(pieces) == full.text
    if len(full.text) > 6:
        stop = full.text[3:6]
        cut = m.generate("ROMEO:", max_new_tokens=24, ignore_eos=True, stop=[stop])
        assert cut.finish_reason == "stop" and stop not in cut.text
        assert full.text.startswith(cut.text) and cut.text == full.text[: full.text.find(stop)]


def test_sampling_is_seeded(model_dir):
    m = trapetum.load(model_dir)
    kw = dict(max_new_tokens=16, temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, repetition_penalty=1.2,
              ignore_eos=True)
    a, b = m.generate("the", seed=7, **kw), m.generate("the", seed=7, **kw)
    assert a.token_ids == b.token_ids
    c = m.generate("the", seed=8, **kw)
    assert c.token_ids != a.token_ids


def test_cli_generate_on_hf_dir(model_dir):
    r = subprocess.run([sys.executable, "-m", "trapetum.cli", "generate", str(model_dir), "ROMEO:",
                        "--max-new-tokens", "8", "--ignore-eos"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    m = trapetum.load(model_dir)
    assert r.stdout == "ROMEO:" + m.generate("ROMEO:", max_new_tokens=8, ignore_eos=True).text + "\n"


def test_context_overflow_is_an_error(model_dir):
    m = trapetum.load(model_dir, max_context=16)
    with pytest.raises(trapetum.TrapetumError, match="exceeds the context size of 16"):
        m.generate("ROMEO: hello there", max_new_tokens=12)


def test_sharded_safetensors_with_index(tmp_path):
    """A checkpoint split over several safetensors files with model.safetensors.index.json."""
    import torch
    hf = build("qwen2", tmp_path / "one")
    hf.save_pretrained(tmp_path / "many", safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "many" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "many").glob("*.safetensors"))) > 1
    ids = list(range(3, 30))
    a = trapetum.load(tmp_path / "one").logits(ids)
    b = trapetum.load(tmp_path / "many").logits(ids)
    assert torch.equal(a, b)
    (tmp_path / "many" / "model-00002-of-{:05d}.safetensors".format(
        len(list((tmp_path / "many").glob("*.safetensors"))))).unlink()
    with pytest.raises(trapetum.FormatError, match="not found"):
        trapetum.load(tmp_path / "many")
