"""Start ``moeinfra serve up`` as a child process and wait until it serves (for benchmarks, the
report and tests)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

READY = re.compile(r"ready at (http://[^/\s]+)/v1")


class ServerProcess:
    """``moeinfra serve up --port 0 ARGS``; ``url`` once ready; its stderr lines in ``log``."""

    def __init__(self, args: list[str], timeout_s: float = 180.0) -> None:
        cmd = [sys.executable, "-m", "moeinfra.cli", "serve", "up", "--port", "0", *args]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
        self.log: list[str] = []
        self._ready = threading.Event()
        self.url: str | None = None
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout_s) or self.url is None:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.log))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            match = READY.search(line)
            if match:
                self.url = match.group(1)
                self._ready.set()
        self._ready.set()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Signal the server (default: drain) and wait; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
