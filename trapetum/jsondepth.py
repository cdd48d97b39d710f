"""Nesting depth of a JSON text, measured before ``json.loads`` sees untrusted input.

``json.loads`` recurses once per nesting level; a deeply nested body raises RecursionError, and on
CPython 3.11 a RecursionError caught in a thread can leave the interpreter's AST recursion counter
wrong, so that a later ``compile()``/``ast.parse`` in that thread fails with "AST constructor
recursion depth mismatch". Readers of request bodies and file headers therefore refuse texts nested
deeper than ``MAX_DEPTH`` before parsing them.
"""
from __future__ import annotations

import re

MAX_DEPTH = 64  # far below the recursion limit; our own JSON nests fewer than 10 levels

_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.S)
_BRACKET = re.compile(r"[\[\]{}]")


def nesting_depth(text: str) -> int:
    """Deepest [ / { nesting outside string literals (0 for scalars); malformed text is measured as is."""
    depth = best = 0
    for m in _BRACKET.finditer(_STRING.sub('""', text)):
        depth += 1 if m.group() in "[{" else -1
        best = max(best, depth)
    return best
