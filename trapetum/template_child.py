"""The chat-template renderer's child process (run by ``trapetum/chat_template.py``; not imported).

A chat template comes from a model file, so it is treated as hostile code: it is compiled and rendered here,
in a separate process that needs nothing but the standard library and jinja2, under the OS's limits (its
address space capped with RLIMIT_AS; its CPU time with RLIMIT_CPU as a backstop for an orphaned child) while
the parent enforces the wall-clock timeout by killing it. The jinja2 environment is the one transformers
uses (immutable sandbox, trim_blocks, lstrip_blocks, loopcontrols, ``tojson``, ``raise_exception``,
``strftime_now``), plus operand limits on ``**``, ``*``, ``+`` and ``%``: a one-line error at once
instead of a long computation or a huge allocation (big-integer powers cannot be interrupted at all).

Protocol, one JSON object per line (no pickle):
  argv:    template_child.py MEMORY_BYTES OUTPUT_CHARS CPU_SECONDS
  stdin:   {"source": TEMPLATE}  then  {"context": {...}}  per render
  stdout:  {"ok": true} | {"error": MSG}  (compilation), then per render
           {"text": STR, "maxrss_kb": N} | {"error": MSG, "rejected": BOOL, "maxrss_kb": N}
``rejected`` marks the template's own ``raise_exception`` (a refusal of the messages it was given).
"""
from __future__ import annotations

import json
import math
import re
import resource
import sys
from datetime import datetime

MAX_INT_BITS = 4096          # integers a template may compute (~1,233 decimal digits)
MAX_SEQUENCE = 1 << 20       # items (characters) a single *, + or % may produce
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


class TemplateRejected(Exception):
    """raise_exception() in the template."""


class Limit(Exception):
    """An operation past the operand limits."""


def _raise(message=""):
    raise TemplateRejected(str(message))


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_binop(op: str, a, b) -> None:
    if op == "**":
        if _int(a) and _int(b) and b > 0 and abs(a) > 1 and abs(a).bit_length() * b > MAX_INT_BITS:
            raise Limit(f"{a if abs(a) < 10 ** 6 else 'an integer'} ** {b} is larger than {MAX_INT_BITS} bits")
    elif op == "*":
        if _int(a) and _int(b) and a.bit_length() + b.bit_length() > MAX_INT_BITS:
            raise Limit(f"a product of integers larger than {MAX_INT_BITS} bits")
        for seq, n in ((a, b), (b, a)):
            if isinstance(seq, (str, list, tuple)) and _int(n) and len(seq) * n > MAX_SEQUENCE:
                raise Limit(f"repeating a {type(seq).__name__} of {len(seq)} items {n} times is past the "
                            f"limit of {MAX_SEQUENCE} items")
    elif op == "+":
        if isinstance(a, (str, list, tuple)) and isinstance(b, (str, list, tuple)) \
                and len(a) + len(b) > MAX_SEQUENCE:
            raise Limit(f"a concatenation of {len(a) + len(b)} items is past the limit of {MAX_SEQUENCE}")
    elif op == "%" and isinstance(a, str):
        for m in _PERCENT_SPEC.finditer(a):
            for width in m.groups():
                if width == "*" or (width is not None and len(width) > 5):
                    raise Limit("a %-format width or precision past 99999")


def make_environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["**", "*", "+", "%"])

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(str(fmt))
    return env


def _describe(e: BaseException) -> str:
    import jinja2
    if isinstance(e, MemoryError):
        return "it needs more memory than the renderer's limit"
    if isinstance(e, RecursionError):
        return "it recurses too deeply"
    if isinstance(e, Limit):
        return str(e)
    text = " ".join(str(e).split())[:300]
    if isinstance(e, jinja2.TemplateError):
        return text or type(e).__name__
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _rss_kb() -> int:
    """This process's peak RSS in KiB: VmHWM of its own address space. (ru_maxrss would not do: Linux carries a
    forked parent's peak into the child across exec, so a large parent, e.g. a long test run, would be counted.)"""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _send(obj) -> None:
    out = sys.stdout
    try:
        line = json.dumps(obj, ensure_ascii=True)
    except (ValueError, TypeError, RecursionError, MemoryError) as e:
        line = json.dumps({"error": f"the output cannot be returned ({type(e).__name__})", "rejected": False})
    out.write(line + "\n")
    out.flush()


def _render(template, context: dict, max_chars: int) -> str:
    parts, n = [], 0
    for piece in template.generate(**context):
        n += len(piece)
        if n > max_chars:
            raise Limit(f"its output is longer than the limit of {max_chars} characters")
        parts.append(piece)
    return "".join(parts)


def main(argv: list[str]) -> int:
    memory, max_chars, cpu_s = int(argv[1]), int(argv[2]), int(argv[3])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    sys.setrecursionlimit(2000)
    stdin = sys.stdin.buffer
    try:
        source = json.loads(stdin.readline())["source"]
        template = make_environment().from_string(source)
    except BaseException as e:  # noqa: BLE001 -- every failure is reported, none raised
        _send({"error": f"it does not compile: {_describe(e)}"})
        return 0
    _send({"ok": True})
    while True:
        line = stdin.readline()
        if not line:
            return 0            # the parent closed the pipe (or exited)
        used = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(math.ceil(used.ru_utime + used.ru_stime)) + cpu_s
        resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.RLIM_INFINITY))
        try:
            context = json.loads(line)["context"]
            text = _render(template, context, max_chars)
        except TemplateRejected as e:
            _send({"error": " ".join(str(e).split())[:300], "rejected": True, "maxrss_kb": _rss_kb()})
        except BaseException as e:  # noqa: BLE001
            _send({"error": _describe(e), "rejected": False, "maxrss_kb": _rss_kb()})
        else:
            _send({"text": text, "maxrss_kb": _rss_kb()})
        del line


if __name__ == "__main__":
    sys.exit(main(sys.argv))
