"""A `cpserve` command as a child process in a test: killed on the way out if it still runs."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from typing import Iterator


@contextlib.contextmanager
def cli_process(argv: list[str], **popen_kw) -> Iterator[subprocess.Popen]:
    """``python -m cpserve.cli *argv``; ``popen_kw`` go to ``subprocess.Popen`` (text mode on)."""
    proc = subprocess.Popen([sys.executable, "-m", "cpserve.cli", *argv], text=True, **popen_kw)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
