"""`trapetum chat` in a real pseudo-terminal: type a message, read the streamed answer."""
import os
import pty
import select
import subprocess
import sys
import time

import trapetum


def read_until(fd, needle: bytes, timeout: float) -> bytes:
    buf = b""
    end = time.time() + timeout
    while time.time() < end and needle not in buf:
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
    return buf


def test_chat_in_a_pty():
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "trapetum.cli", "chat", "--temperature", "0",
                             "--max-new-tokens", "12"], stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    try:
        banner = read_until(master, b"> ", 180)
        assert b"trapetum chat" in banner, banner
        os.write(master, b"What is the capital of France?\r")
        out = read_until(master, b"\r\n> ", 180)
        text = out.decode("utf-8", "replace")
        answer = text.split("What is the capital of France?", 1)[-1].rsplit("> ", 1)[0].strip()
        expected = trapetum.load().chat([{"role": "user", "content": "What is the capital of France?"}],
                                        max_new_tokens=12, temperature=0).text.strip()
        assert answer == expected.replace("\n", "\r\n"), (answer, expected)
        assert "Paris" in answer
        os.write(master, b"/exit\r")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
