"""settings.py: every switch parsed once, one truthiness rule, bad values named; options passed, never read."""
import pytest

from trapetum.errors import ConfigError
from trapetum.settings import KernelOptions, Options


@pytest.mark.parametrize("value,want", [("1", True), ("true", True), ("ON", True), ("yes", True), ("0", False),
                                        ("false", False), ("Off", False), ("no", False), ("", True), (None, True)])
def test_one_truthiness_rule(value, want):
    env = {} if value is None else {"TRAPETUM_FUSE": value, "TRAPETUM_TC": value, "TRAPETUM_GRAPH": value}
    o = Options.from_env(env)
    assert o.fuse is want and o.kernels.cuda is want and o.graph is want


@pytest.mark.parametrize("name,value", [("TRAPETUM_FUSE", "maybe"), ("TRAPETUM_TC", "2"), ("TRAPETUM_ATTN", "seq"),
                                        ("TRAPETUM_PREFILL", "fast"), ("TRAPETUM_ENGINE", "cpu"),
                                        ("TRAPETUM_AQLM_BPS", "0"), ("TRAPETUM_AQLM_BPS", "x"),
                                        ("TRAPETUM_CALIB_MEM_GB", "-1"), ("TRAPETUM_PDL", "sometimes")])
def test_bad_values_are_named(name, value):
    with pytest.raises(ConfigError, match=name):
        Options.from_env({name: value})


def test_defaults_are_production_whatever_the_environment(monkeypatch):
    monkeypatch.setenv("TRAPETUM_FUSE", "0")
    monkeypatch.setenv("TRAPETUM_TC", "0")
    assert Options().fuse and KernelOptions().cuda
    assert not Options.from_env().fuse and not Options.from_env().kernels.cuda


def test_replace_updates_kernel_fields():
    o = Options().replace(fuse=False, kernels={"pdl": "off"})
    assert not o.fuse and o.kernels.pdl == "off" and o.kernels.cuda and not o.kernels.pdl_cuda
    with pytest.raises(ConfigError, match="attention"):
        Options(attention="seq")


def test_no_module_reads_the_environment():
    """Only settings.py (and the Triton interpreter check it owns) reads os.environ in the package."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[1] / "trapetum"
    bad = []
    for f in root.rglob("*.py"):
        if f.name == "settings.py":
            continue
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if re.search(r"os\.environ|os\.getenv|getenv\(", line.split("#")[0]):
                bad.append(f"{f.relative_to(root)}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)
