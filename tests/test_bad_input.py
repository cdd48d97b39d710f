"""Bad input: one-line error naming the file and the problem, non-zero exit, no traceback."""
import json
import subprocess
import sys

import pytest

from tests.tiny_models import build


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "trapetum.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def assert_user_error(r, *fragments):
    assert r.returncode != 0
    err = r.stderr.strip()
    assert "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("trapetum: error:"), err
    for f in fragments:
        assert f in err, (f, err)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    build("llama2", d)
    return d


def copy_dir(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_path(tmp_path):
    assert_user_error(cli("info", tmp_path / "nope.gguf"), "nope.gguf", "not found")


def test_dir_without_config(tmp_path):
    assert_user_error(cli("info", tmp_path), "config.json", "not found")


def test_truncated_safetensors(llama_dir, tmp_path):
    d = copy_dir(llama_dir, tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    assert_user_error(cli("generate", d, "hi", "--max-new-tokens", "1"), "model.safetensors")


def test_corrupt_safetensors_header(llama_dir, tmp_path):
    d = copy_dir(llama_dir, tmp_path / "m")
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:40] = b"\xff" * 32
    f.write_bytes(bytes(data))
    assert_user_error(cli("info", d), "model.safetensors")


def test_garbage_safetensors(llama_dir, tmp_path):
    d = copy_dir(llama_dir, tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"not a safetensors file at all")
    assert_user_error(cli("info", d), "model.safetensors")


def test_unknown_architecture(llama_dir, tmp_path):
    d = copy_dir(llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "mamba9000"
    (d / "config.json").write_text(json.dumps(cfg))
    assert_user_error(cli("info", d), "config.json", "mamba9000")


def test_config_not_json(llama_dir, tmp_path):
    d = copy_dir(llama_dir, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    assert_user_error(cli("info", d), "config.json", "JSON")


def test_inconsistent_heads(llama_dir, tmp_path):
    d = copy_dir(llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_key_value_heads"] = 3  # 4 heads are not a multiple of 3
    (d / "config.json").write_text(json.dumps(cfg))
    assert_user_error(cli("info", d), "config.json", "num_kv_heads")


def test_shapes_disagree_with_config(llama_dir, tmp_path):
    d = copy_dir(llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 128  # tensors are 96 wide
    (d / "config.json").write_text(json.dumps(cfg))
    assert_user_error(cli("generate", d, "hi", "--max-new-tokens", "1"), "gate_proj", "shape")


def test_missing_tensor(llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    d = copy_dir(llama_dir, tmp_path / "m")
    t = load_file(d / "model.safetensors")
    del t["model.layers.1.mlp.up_proj.weight"]
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    assert_user_error(cli("generate", d, "hi", "--max-new-tokens", "1"), "model.layers.1.mlp.up_proj.weight",
                      "missing")


def test_pickle_only_dir_refused(llama_dir, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text((llama_dir / "config.json").read_text())
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
    assert_user_error(cli("info", d), "pickle")


def test_bad_sampling_argument(llama_dir):
    assert_user_error(cli("generate", llama_dir, "hi", "--top-p", "1.5"), "--top-p", "(0, 1]")


def test_not_a_model_file(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("hello")
    assert_user_error(cli("info", f), "notes.txt", "not a model")


@pytest.mark.parametrize("field,value,fragment", [
    ("rope_theta", "abc", "rope_theta"), ("rope_theta", [1], "rope_theta"), ("num_hidden_layers", 10**9, "num_hidden_layers"),
    ("num_hidden_layers", True, "num_hidden_layers"), ("rope_scaling", [["type", "linear"]], "rope_scaling"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 4}, "high_freq"),
    ("rope_scaling", {"rope_type": "linear"}, "factor"), ("layer_types", [1, 2], "layer_types"),
    ("num_key_value_heads", "2", "num_key_value_heads"), ("rms_norm_eps", -1.0, "rms_norm_eps"),
    ("max_position_embeddings", 2**40, "max_position_embeddings"), ("hidden_act", ["silu"], "hidden_act"),
    ("tie_word_embeddings", "no", "tie_word_embeddings"), ("head_dim", 3, "rotary"),
    ("rope_parameters", {"rope_theta": "x"}, "rope_parameters.rope_theta"),
])
def test_hostile_config_values(llama_dir, tmp_path, field, value, fragment):
    """Issue 21 (3): every config.json value is type- and range-checked (ModelConfig.validate, config_from_hf),
    in process (ConfigError naming the file and field) before anything is sized by it."""
    from trapetum.errors import TrapetumError
    from trapetum.formats.hf import load_hf
    d = copy_dir(llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    if field.startswith("rope_"):
        cfg.pop("rope_parameters", None)      # transformers 5's form would take precedence over the classic keys
    cfg[field] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TrapetumError, match=fragment) as e:
        load_hf(d)
    assert str(e.value).startswith(str(d / "config.json")) and "\n" not in str(e.value)


def test_hostile_tokenizer_config(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    build("llama2", d, tokenizer=True)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["chat_template"] = 12345
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    assert_user_error(cli("generate", d, "hi", "--chat", "--max-new-tokens", "1"), "tokenizer_config.json",
                      "chat_template")
    (d / "tokenizer_config.json").write_text("[" * 100000 + "]" * 100000)
    assert_user_error(cli("info", d), "tokenizer_config.json", "nested")
