"""Every collective and point-to-point message of a rank goes through engine/parallel/comm.py.

An AST scan of every module outside tests/ for references to torch.distributed's collectives
and point-to-point calls (``dist.broadcast(...)``, ``torch.distributed.isend``, ``from
torch.distributed import all_reduce``), through whatever name the module imported it under.
Group setup (init_process_group, new_group, TCPStore, destroy_process_group, is_initialized) is
not a collective and is not flagged.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DIST = "torch.distributed"
COLLECTIVES = ("all_reduce", "all_gather", "all_to_all", "reduce", "broadcast", "gather", "scatter", "barrier",
               "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp")
ALLOWED_FILES = {"engine/parallel/comm.py"}  # the seam itself
ALLOWED_FUNCTIONS = {
    # times gloo's own all-reduce: the baseline the shared-memory path is measured against
    ("bench/decode_dcp.py", "bench_ping"),
}


def is_collective(qualname: str) -> bool:
    """True for torch.distributed.<collective> (any submodule, e.g. distributed_c10d)."""
    if not qualname.startswith(DIST + "."):
        return False
    return qualname.rpartition(".")[2].startswith(COLLECTIVES)


class _Scan(ast.NodeVisitor):
    """Collects (line, enclosing function, qualified name) of each reference to a collective."""

    def __init__(self):
        self.names: dict[str, str] = {}  # local name → the module or object it is bound to
        self.found: list[tuple[int, str, str]] = []
        self.functions: list[str] = []

    def _flag(self, node: ast.AST, qualname: str) -> None:
        if is_collective(qualname):
            self.found.append((node.lineno, self.functions[-1] if self.functions else "", qualname))

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.asname:
                self.names[a.asname] = a.name
            else:  # `import torch.distributed` binds `torch`
                root = a.name.partition(".")[0]
                self.names[root] = root

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for a in node.names:
            qualname = f"{node.module}.{a.name}"
            self.names[a.asname or a.name] = qualname
            self._flag(node, qualname)

    def visit_FunctionDef(self, node) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def _resolve(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.names.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._resolve(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        qualname = self._resolve(node)
        if qualname is not None:
            self._flag(node, qualname)  # a chain is resolved whole: its inner links are not collectives
        else:
            self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in self.names:
            self._flag(node, self.names[node.id])


def direct_collectives(source: str) -> list[tuple[int, str, str]]:
    """(line, enclosing function, e.g. "torch.distributed.broadcast") of each direct use."""
    scan = _Scan()
    tree = ast.parse(source)
    for node in ast.walk(tree):  # imports first, wherever they are: a function may import late
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            scan.visit(node)
    scan.found.clear()  # imports are flagged again, with their function, below
    scan.visit(tree)
    return scan.found


def modules() -> list[Path]:
    tops = [p for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "tests"
            and not p.name.endswith(".egg-info")]
    return sorted(f for top in tops for f in top.rglob("*.py"))


def test_no_module_calls_torch_distributed_collectives_but_comm():
    files = modules()
    assert any(f.relative_to(REPO).as_posix() == "engine/parallel/prefill_cp.py" for f in files)
    bad = []
    for f in files:
        rel = f.relative_to(REPO).as_posix()
        if rel in ALLOWED_FILES:
            continue
        for line, function, name in direct_collectives(f.read_text()):
            if (rel, function) not in ALLOWED_FUNCTIONS:
                bad.append(f"{rel}:{line} ({function or 'module'}): {name}")
    assert not bad, "call these through engine/parallel/comm.py's Comm:\n" + "\n".join(bad)


def test_the_scan_sees_every_spelling_and_passes_group_setup():
    source = """
import torch
import torch.distributed as dist
from torch import distributed as td
from torch.distributed import all_reduce as ar, init_process_group

def f(x, comm, other):
    dist.broadcast(x, 0)
    td.all_gather_single(x, x)
    torch.distributed.barrier()
    ar(x)
    fn = dist.reduce_scatter_single
    dist.distributed_c10d.all_to_all_single(x, x)
    dist.init_process_group("gloo")
    dist.is_initialized()
    dist.new_group()
    dist.TCPStore("127.0.0.1", 1)
    comm.broadcast(x, 0)
    other.all_reduce(x)
    torch.add(x, x)

def g(x):
    import torch.distributed as d
    d.isend(x, 1)
    d.batch_isend_irecv([])
"""
    found = direct_collectives(source)
    assert [(line, fn, name.removeprefix(DIST + ".")) for line, fn, name in found] == [
        (5, "", "all_reduce"),
        (8, "f", "broadcast"), (9, "f", "all_gather_single"), (10, "f", "barrier"), (11, "f", "all_reduce"),
        (12, "f", "reduce_scatter_single"), (13, "f", "distributed_c10d.all_to_all_single"),
        (24, "g", "isend"), (25, "g", "batch_isend_irecv"),
    ]
