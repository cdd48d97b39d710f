"""Chat templates rendered under limits: a child process per template, killed when it runs too long.

A chat template is code from a model file. It runs in jinja2's immutable sandbox (what transformers does),
and that sandbox stops attribute gadgets, but not work: ``{{ 9 ** (9 ** 8) }}`` holds the interpreter for
minutes (a big-integer power cannot be interrupted), ``'A' * 2000000000`` allocates 2 GB, nested loops run
for ever. So templates are compiled and rendered in ``template_child.py``, a small process of its own
(stdlib + jinja2), under ``TemplateLimits``:

- ``timeout_s`` wall clock per render, enforced here by killing the child (the next render starts a new one);
- ``memory_bytes`` of address space for the child (RLIMIT_AS: an allocation past it is a MemoryError there);
- ``output_chars`` of rendered text;
- operand limits on ``**``, ``*``, ``+``, ``%`` inside the sandbox (an immediate, precise error).

Every failure is a ChatTemplateError with a one-line reason; ``rejected`` is True when the template itself
refused the messages (its ``raise_exception``, e.g. "roles must alternate"), which is the caller's input
at fault rather than the model file's. A waiting caller holds no lock the rest of the process needs (it
blocks in ``select``), so other threads, other models and an event loop keep running.

Children are kept per template source (at most ``MAX_RENDERERS``, least recently used closed first), serve
renders one at a time, and exit when this process closes their stdin (or exits).
"""
from __future__ import annotations

import atexit
import collections
import json
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import TrapetumError

CHILD = Path(__file__).with_name("template_child.py")
MAX_RENDERERS = 8
START_TIMEOUT_S = 60.0      # the child's interpreter start and compilation (a busy machine is slow to start)


class ChatTemplateError(TrapetumError):
    """A chat template that failed to compile or render. ``reason`` is the message without the model's name;
    ``rejected``: the template's own raise_exception refused the messages."""

    def __init__(self, message: str, *, reason: str | None = None, rejected: bool = False):
        super().__init__(message)
        self.reason = reason or message
        self.rejected = rejected


@dataclass(frozen=True)
class TemplateLimits:
    timeout_s: float = 5.0
    memory_bytes: int = 1 << 30
    output_chars: int = 1 << 22

    def __post_init__(self):
        if not (0 < self.timeout_s <= 3600 and 64 << 20 <= self.memory_bytes and 0 < self.output_chars):
            raise ValueError(f"bad template limits {self}")


DEFAULT_LIMITS = TemplateLimits()


class _Dead(Exception):
    """The child is gone (exited, killed, or its pipe broke); ``before`` when the request never reached it."""

    def __init__(self, before: bool = False):
        super().__init__()
        self.before = before


class TemplateRenderer:
    """One child process rendering one template source; thread-safe (renders take turns)."""

    def __init__(self, source: str, limits: TemplateLimits = DEFAULT_LIMITS):
        self.source = source
        self.limits = limits
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.compile_error: str | None = None   # deterministic: kept, never retried
        self.last_maxrss_kb = 0                  # the child's peak RSS after the last render (tests)
        self._buf = b""

    # -- the child ----------------------------------------------------------------------------
    def _spawn(self) -> None:
        cpu = int(self.limits.timeout_s) + 2
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", str(CHILD), str(self.limits.memory_bytes), str(self.limits.output_chars),
                 str(cpu)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                close_fds=True, start_new_session=True)
        except OSError as e:
            raise ChatTemplateError(f"the chat template renderer cannot start ({e.strerror or e})") from None
        self._buf = b""
        try:
            reply = self._exchange({"source": self.source}, START_TIMEOUT_S)
        except (_Dead, TimeoutError):
            self._kill()
            why = f"the chat template renderer ({CHILD.name}) did not start"
            raise ChatTemplateError(why, reason=why) from None
        if "error" in reply:
            self.compile_error = str(reply["error"])
            self._kill()

    def _kill(self) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        for f in (p.stdin, p.stdout):
            try:
                f.close()
            except OSError:
                pass
        if p.poll() is None:
            p.kill()
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def _exchange(self, obj: dict, timeout: float) -> dict:
        """Send one request line, read one reply line within ``timeout`` (TimeoutError) or raise _Dead."""
        p = self.proc
        assert p is not None and p.stdin is not None and p.stdout is not None
        try:
            p.stdin.write(json.dumps(obj, ensure_ascii=True).encode("ascii") + b"\n")
            p.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise _Dead(before=True) from None
        fd = p.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise _Dead()
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            reply = json.loads(line)
        except ValueError:
            raise _Dead() from None
        if not isinstance(reply, dict):
            raise _Dead()
        return reply

    # -- rendering ----------------------------------------------------------------------------
    def render(self, context: dict[str, Any]) -> str:
        """The rendered text (ChatTemplateError on any failure, after at most ``limits.timeout_s``)."""
        try:
            request = {"context": context}
            json.dumps(request, ensure_ascii=True)
        except (TypeError, ValueError, RecursionError) as e:
            raise ChatTemplateError(f"the messages cannot be passed to the chat template: {e}") from None
        if not self.lock.acquire(timeout=self.limits.timeout_s + START_TIMEOUT_S):
            raise ChatTemplateError("the chat template renderer is busy (an earlier render has not finished)")
        try:
            for attempt in (0, 1):
                if self.compile_error is not None:
                    raise ChatTemplateError(f"chat template: {self.compile_error}", reason=self.compile_error)
                try:
                    if self.proc is None or self.proc.poll() is not None:
                        self._kill()
                        self._spawn()
                        if self.compile_error is not None:
                            continue
                    reply = self._exchange(request, self.limits.timeout_s)
                except TimeoutError:
                    self._kill()
                    why = f"rendering took longer than {self.limits.timeout_s:g} s"
                    raise ChatTemplateError(f"chat template: {why}", reason=why) from None
                except _Dead as e:
                    self._kill()
                    if attempt == 0 and e.before:
                        continue        # a child that died between renders: start a fresh one once
                    why = "the renderer died while rendering it (out of memory or CPU time?)"
                    raise ChatTemplateError(f"chat template: {why}", reason=why) from None
                self.last_maxrss_kb = int(reply.get("maxrss_kb") or 0)
                if "text" in reply and isinstance(reply["text"], str):
                    return reply["text"]
                why = str(reply.get("error") or "no output")
                rejected = bool(reply.get("rejected"))
                msg = f"chat template refused the messages: {why}" if rejected else f"chat template failed: {why}"
                raise ChatTemplateError(msg, reason=why, rejected=rejected)
            raise ChatTemplateError(f"chat template: {self.compile_error}", reason=self.compile_error)
        finally:
            self.lock.release()

    def close(self) -> None:
        with self.lock:
            self._kill()


_renderers: collections.OrderedDict[tuple[str, TemplateLimits], TemplateRenderer] = collections.OrderedDict()
_renderers_lock = threading.Lock()


def renderer_for(source: str, limits: TemplateLimits = DEFAULT_LIMITS) -> TemplateRenderer:
    """The shared renderer of ``source`` (created on first use; the least recently used beyond
    MAX_RENDERERS is closed)."""
    key = (source, limits)
    with _renderers_lock:
        r = _renderers.get(key)
        if r is not None:
            _renderers.move_to_end(key)
            return r
        r = _renderers[key] = TemplateRenderer(source, limits)
        old = [_renderers.popitem(last=False)[1] for _ in range(max(0, len(_renderers) - MAX_RENDERERS))]
    for o in old:
        threading.Thread(target=o.close, daemon=True).start()    # may wait for a render in progress
    return r


def render_chat_template(source: str, context: dict[str, Any], limits: TemplateLimits = DEFAULT_LIMITS) -> str:
    return renderer_for(source, limits).render(context)


@atexit.register
def _close_all() -> None:
    """Children exit by themselves when this process's pipes close; this just does it without waiting."""
    with _renderers_lock:
        rs = list(_renderers.values())
        _renderers.clear()
    for r in rs:
        if r.lock.acquire(timeout=0.1):
            try:
                r._kill()
            finally:
                r.lock.release()
