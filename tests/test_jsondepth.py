"""Nesting depth of untrusted JSON is measured before json.loads can recurse."""
import json
import random

from trapetum.jsondepth import MAX_DEPTH, nesting_depth


def test_depth_ignores_brackets_in_strings():
    assert nesting_depth("5") == 0
    assert nesting_depth("{}") == 1
    assert nesting_depth('[[1], [2, [3]]]') == 3
    assert nesting_depth('"[[[[{{{{"') == 0
    assert nesting_depth(r'{"a": "\"[[[", "b": [{}]}') == 3


def test_depth_matches_random_documents():
    r = random.Random(0)

    def doc(d):
        if d == 0 or r.random() < 0.2:
            return r.choice([1, "x[{", None, 2.5, 'q"]}'])
        return [doc(d - 1) for _ in range(r.randint(1, 3))] if r.random() < 0.5 else \
            {f"k{i}[": doc(d - 1) for i in range(r.randint(1, 3))}

    def depth(o):
        if isinstance(o, list):
            return 1 + max((depth(v) for v in o), default=0)
        if isinstance(o, dict):
            return 1 + max((depth(v) for v in o.values()), default=0)
        return 0
    for _ in range(300):
        o = doc(r.randint(0, 8))
        assert nesting_depth(json.dumps(o)) == depth(o)


def test_deep_text_is_measured_without_recursion():
    assert nesting_depth("[" * 100000 + "]" * 100000) == 100000 > MAX_DEPTH
