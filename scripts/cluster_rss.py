"""Memory of a whole `cpserve up` cluster: start it, wait for its demo, sum every process.

    .venv/bin/python scripts/cluster_rss.py [--json] [-- <cpserve up args>]

Starts `cpserve up` with the given arguments (default: none, i.e. the embedded tiny model,
prefill CP 2 + decode DCP 2), waits for the "Ctrl-C stops every service." line (the cluster is
up and its demo request has finished), then reads VmRSS and VmHWM (peak RSS) from
/proc/<pid>/status of `up` and every process below it (services, rank processes, Mooncake's
helpers) and stops the cluster. Prints one line per process kind and the totals; with --json,
the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def _tree(root: int) -> list[tuple[int, str]]:
    """(pid, kind) of ``root`` and every process below it; a rank is named after its service."""
    seen, todo = [], [(root, "")]
    while todo:
        pid, parent = todo.pop()
        kind = _kind(pid, parent)
        seen.append((pid, kind))
        todo += [(c, kind) for c in _children(pid)]
    return seen


def _kind(pid: int, parent: str) -> str:
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    text = " ".join(words)
    if "resource_tracker" in text:
        return "mp tracker"
    if "spawn_main" in text:
        return f"{parent} rank"
    if "serve" in words:
        return words[words.index("serve") + 1]
    if "up" in words:
        return "up"
    return Path(words[0]).name


def measure(up_args: list[str], timeout_s: float = 600.0) -> dict:
    cmd = [sys.executable, "-m", "cpserve.cli", "up", *up_args]  # this checkout's code (cwd=ROOT)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines = []
    deadline = time.monotonic() + timeout_s
    try:
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops every service." in line:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("cpserve up did not come up in time")
        else:
            raise RuntimeError("cpserve up exited:\n" + "".join(lines[-30:]))
        procs = []
        for pid, kind in _tree(proc.pid):
            st = _status(pid)
            if st:
                procs.append({"pid": pid, "kind": kind, "rss": st.get("VmRSS", 0), "hwm": st.get("VmHWM", 0)})
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    kinds: dict[str, dict] = {}
    for p in procs:
        k = kinds.setdefault(p["kind"], {"processes": 0, "rss": 0, "hwm": 0})
        k["processes"] += 1
        k["rss"] += p["rss"]
        k["hwm"] += p["hwm"]
    return {"args": up_args, "processes": len(procs), "rss_bytes": sum(p["rss"] for p in procs),
            "hwm_bytes": sum(p["hwm"] for p in procs), "by_kind": kinds,
            "demo": [line.strip() for line in lines if line.strip().startswith("demo")]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    up_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(ours)
    result = measure(up_args)
    gib = 1 << 30
    print(f"cpserve up {' '.join(up_args)}: {result['processes']} processes")
    print(f"{'kind':14} {'procs':>5} {'RSS GiB':>9} {'peak GiB':>9}")
    for kind, k in sorted(result["by_kind"].items()):
        print(f"{kind:14} {k['processes']:5d} {k['rss'] / gib:9.3f} {k['hwm'] / gib:9.3f}")
    print(f"{'total':14} {result['processes']:5d} {result['rss_bytes'] / gib:9.3f} {result['hwm_bytes'] / gib:9.3f}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
