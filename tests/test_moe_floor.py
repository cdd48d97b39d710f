"""eval/moe_floor.py: the bytes a decode step reads, by hand for Mixtral-8x7B's shape, and its argument errors."""
from trapetum.eval import moe_floor


def test_mixtral_cb4_bytes_by_hand():
    b = moe_floor.step_bytes("mixtral-8x7b", "cb4", position=64)
    per_expert = 2 * (14336 * 4096 // 2 + 14336 * 32) + \
        (4096 * 14336 // 2 + 4096 * 32)
    assert b["experts_all"] == 32 * 8 * per_expert
    assert b["experts_active"] == 32 * 2 * per_expert
    assert b["kv_now"] == b["kv_latent"] == 2 * 8 * 128 * 2 * 32 * 64


def test_deepseek_latent_kv_and_errors(capsys):
    b = moe_floor.step_bytes("deepseek-v2-lite", "fp16", position=10)
    assert b["kv_latent"] == 576 * 2 * 27 * 10 and b["kv_now"] == 2 * 16 * 192 * 2 * 27 * 10
    assert moe_floor.main(["--models", "nope"]) == 2
    assert moe_floor.main(["--formats", "cb3"]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2 and "--models" in out[0] and "--formats" in out[1]
