"""Tokenizers built from GGUF vocabularies agree with transformers' GGUF tokenizer, id for id.

SmolLM2 (byte-level BPE, "smollm" split) runs in CI; Gemma-3 (SentencePiece BPE, merges derived
from the vocabulary) and Qwen2.5 (byte-level BPE, "qwen2" split) are marked slow.
"""
from __future__ import annotations

import warnings

import pytest

from real_models import hf_reference, require

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    " leading space",
    "  two leading spaces",
    "trailing spaces  ",
    "The year 2024: 1234567 items cost $3.14159 (approx.), 10,000,000 or 1e-9!",
    "def f(x):\n    return x**2  # square\n\n\tif x:\n\t\tpass\n",
    "naïve café Ünïcödé — “quotes” ‘x’ «ok» 日本語のテキスト 中文 한국어 עברית العربية Ελληνικά",
    "emoji 😀👍🏽🇫🇷 👨‍👩‍👧 ✨🚀",
    "   \n\n\n   \t\t  whitespace   runs      end \n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|endoftext|>",
    "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n<eos>",
    "<s> [INST] question [/INST] answer</s>",
    "",
    " ",
    "\n",
    "a\r\nb\rc",
    "I'm sure they'll say WE'VE done it; it's John's",
    "https://example.com/path?q=1&r=2#frag <a href='x'>link</a>",
    "x" * 300,
    "ÀÁÂÃÄÅ ﬁ ﬂ ½ ² Ⅻ ｆｕｌｌｗｉｄｔｈ",
    "\u200bzero\u00a0width and nbsp",
    "<unk><pad><mask> <think>reason</think>",
    "<|fim_prefix|>def a():<|fim_suffix|>\n<|fim_middle|>",
]
MESSAGES = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a prime."}],
]

_cache: dict[str, tuple] = {}


def pair(name: str):
    """(our Tokenizer, transformers tokenizer) for one real model, loaded once per session."""
    if name not in _cache:
        from trapetum.formats.gguf import load_gguf

        ours = load_gguf(require(name)).tokenizer
        _cache[name] = (ours, hf_reference(name, "tokenizer"))
    return _cache[name]


MODELS = [pytest.param("smollm2"), pytest.param("gemma3", marks=pytest.mark.slow),
          pytest.param("qwen25", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name", MODELS)
def test_encode_decode_agree(name):
    ours, ref = pair(name)
    assert ours.vocab_size == len(ref)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref(text, add_special_tokens=special)["input_ids"], (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), \
                    (text, skip)


@pytest.mark.parametrize("name", MODELS)
def test_tokenizer_json_identical(name):
    """Stronger than sampled texts: the whole serialized tokenizer (vocab, merges, added tokens,
    normalizer, pre-tokenizer, post-processor, decoder) equals the one transformers builds."""
    ours, ref = pair(name)
    assert ours.tk.to_str() == ref.backend_tokenizer.to_str()


@pytest.mark.parametrize("name", MODELS)
def test_special_tokens_agree(name):
    ours, ref = pair(name)
    assert ours.bos_token == ref.bos_token
    assert ours.eos_tokens[0] == ref.eos_token
    assert ours.eos_ids[0] == ref.eos_token_id or ref.eos_token_id in ours.eos_ids
    # every token transformers treats as special is special for us too (kept whole, skipped on decode)
    for tok in ref.all_special_tokens:
        i = ours.token_to_id(tok)
        assert i is not None and ours.decode([i], skip_special_tokens=True) == "", tok


@pytest.mark.parametrize("name", MODELS)
def test_chat_template_agrees(name):
    ours, ref = pair(name)
    if ref.chat_template is None:  # Gemma-3-270M's GGUF carries no template; neither side has one
        assert ours.chat_template is None
        return
    assert ours.chat_template == ref.chat_template
    for msgs in MESSAGES:
        for gen in (True, False):
            want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == want
            assert ours.encode_chat(msgs, add_generation_prompt=gen) == \
                ref(want, add_special_tokens=False)["input_ids"]


def test_smollm2_known_ids():
    """Pinned ids (from transformers' GGUF tokenizer) so a regression shows without transformers too."""
    ours, _ = pair("smollm2")
    assert ours.encode("Hello 12345 world  x") == [19556, 216, 33, 34, 35, 36, 37, 905, 216, 1792]
    assert ours.bos_token == "<|im_start|>" and ours.eos_tokens[0] == "<|im_end|>"


def _spm_gguf(tmp_path, add_space_prefix=None, arch="llama"):
    """A tiny llama-arch GGUF with a SentencePiece (llama) vocabulary, as Llama-2/Mistral files have."""
    import gguf

    from test_gguf import hf_tensors, write_gguf

    corpus = "the quick brown fox jumps over the lazy dog. hello world, this is a test of the tokenizer"
    pieces = ["\u2581"] + sorted(set(corpus.replace(" ", "")))
    for w in sorted(set(corpus.replace(",", " ").replace(".", " ").split()), key=lambda w: (len(w), w)):
        s = "\u2581" + w
        pieces += [s[:i] for i in range(2, len(s) + 1) if s[:i] not in pieces]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    arr = gguf.GGUFValueType.ARRAY
    tok = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": (tokens, arr),
           "tokenizer.ggml.scores": (scores, arr), "tokenizer.ggml.token_type": (types, arr)}
    if add_space_prefix is not None:
        tok["tokenizer.ggml.add_space_prefix"] = (add_space_prefix, gguf.GGUFValueType.BOOL)
    V = len(tokens)
    return write_gguf(tmp_path / "spm.gguf", arch, hf_tensors(arch, V=V), V=V, tokenizer=tok,
                      meta_over={"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
                                 "tokenizer.ggml.unknown_token_id": 0})


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_sentencepiece_vocab_agrees(tmp_path, arch):
    """Llama-2 / Phi-3 style vocabulary (scores, byte fallback, no merges): same tokenizer as transformers."""
    from trapetum.formats.gguf import load_gguf

    path = _spm_gguf(tmp_path, arch=arch)
    ours = load_gguf(path).tokenizer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert ours.tk.to_str() == ref.backend_tokenizer.to_str()
    for text in ["the quick brown fox", " hello  world", "  two", "x <s> y", "Hello World! ünïcode 😀", "<s>the</s> dog", "", " ",
                 "the\nlazy\tdog", "<unk> x"]:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref(text, add_special_tokens=special)["input_ids"], text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours.encode("the dog")[0] == 1 and ours.bos_token == "<s>" and ours.eos_tokens == ["</s>"]
