"""The package's layer rule, checked statically: who may import whom, and where jax may go.

ARCHITECTURE.md's contract: "only trace reads jaxpr internals; from graph to plan nothing
imports jax". Each sub-package of ``autoshard`` is one pass and sits on one layer; a module
may import from its own layer or a lower one, so a pass never reaches up into the code that
drives it. The planning packages (ir, hardware, intra, inter) and report must not import jax, jaxlib,
flax or optax anywhere, not even inside a function: the planner stays fast to test and
runs where JAX does not. Every module under ``autoshard/`` is read with ``ast``, so imports
inside functions count as much as those at the top.

Two rules on the shape of the house: no import circle among ``autoshard``'s modules (an
import inside a function or under ``TYPE_CHECKING`` is an edge like any other: deferring
an import hides a circle, it does not break it), and ``intra/`` in rooms (sub-packages),
no loose module beside its ``__init__.py``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# ----------------------------------------------------------------------------- the rules
# Layers, lowest first. A module may import from its own layer or any lower one; the
# top-level file autoshard/api.py (and any api_*.py beside it) is the ``api`` layer.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"ir", "hardware"}),  # artifacts between passes; cluster and GEMM data
    frozenset({"trace", "intra"}),  # the jaxpr reader; the intra-op planner
    frozenset({"inter"}),  # layer clustering, the stage DP, pipeline schedules
    # plans read for people and exported (explain, export): they read plan files, the
    # baselines' rule tables (intra) and pipeline schedules (inter), never a traced step,
    # so they sit above inter and stay jax-free; the simulator is called from cli
    frozenset({"report"}),
    frozenset({"runtime", "verify"}),  # plans made real with jax; compiled HLO read back
    frozenset({"models"}),  # the GPT and MLP workloads
    frozenset({"api"}),  # the one place that chains the passes
    frozenset({"sim", "cli"}),  # the simulator and the command line, on top of it all
)
# Narrower than "own layer or lower": trace is the only jaxpr reader and reads nothing but
# ir, and the intra-op planner knows no jax, so neither of the pair imports the other.
ALLOWED_ONLY: dict[str, frozenset[str]] = {
    "trace": frozenset({"trace", "ir"}),
    "intra": frozenset({"intra", "ir", "hardware"}),
}
# jax-free, even in functions
PLANNING = frozenset({"ir", "hardware", "intra", "inter", "report"})
JAX_PACKAGES = frozenset({"jax", "jaxlib", "flax", "optax"})
# autoshard/__init__.py loads its public names lazily from every layer; __main__.py is the
# entry point. Neither belongs to a layer.
EXEMPT = frozenset({"autoshard/__init__.py", "autoshard/__main__.py"})

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autoshard"
RANK = {name: rank for rank, layer in enumerate(LAYERS) for name in layer}


def allowed(layer: str) -> frozenset[str]:
    """The layers a module of ``layer`` may import from."""
    if layer in ALLOWED_ONLY:
        return ALLOWED_ONLY[layer]
    return frozenset(name for name, rank in RANK.items() if rank <= RANK[layer])


# ----------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Import:
    """One import statement's target, where it stands in the source."""

    path: str  # autoshard/inter/search.py
    line: int
    target: str  # the module imported (autoshard.api, jax.numpy, ...)
    text: str  # the statement as written

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


def module_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of_file(path: Path) -> str:
    """``autoshard/<pkg>/...`` -> pkg; ``autoshard/api.py`` and ``api_*.py`` -> api."""
    parts = path.relative_to(PACKAGE).parts
    if len(parts) > 1:
        return parts[0]
    stem = path.stem
    if stem == "api" or stem.startswith("api_"):
        return "api"
    raise AssertionError(f"{relative(path)} is a top-level module with no layer")


def layer_of_module(name: str) -> str | None:
    """The layer of an ``autoshard`` module name; None for a module outside the package."""
    parts = name.split(".")
    if parts[0] != "autoshard":
        return None
    if len(parts) == 1:
        return "api"  # `from autoshard import name`: the package's public (lazy) API
    head = parts[1]
    if head == "api" or head.startswith("api_"):
        return "api"
    return head


def imports(path: Path) -> list[Import]:
    """Every import in ``path``, at any depth (functions, classes, conditionals)."""
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    package = (
        module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    )
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        text = ast.unparse(node)
        if isinstance(node, ast.Import):
            found += [Import(relative(path), node.lineno, a.name, text) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            if base == "autoshard":  # `from autoshard import sim`: the sub-package itself
                for alias in node.names:
                    sub = PACKAGE / alias.name
                    is_module = sub.is_dir() or sub.with_suffix(".py").exists()
                    target = f"autoshard.{alias.name}" if is_module else "autoshard"
                    found.append(Import(relative(path), node.lineno, target, text))
            else:
                found.append(Import(relative(path), node.lineno, base, text))
    return sorted(found, key=lambda i: i.line)


def checked_files() -> list[Path]:
    return [p for p in module_files() if relative(p) not in EXEMPT]


def module_edges() -> dict[str, dict[str, str]]:
    """module -> {autoshard module it imports: where (``path:line``)}, every import at any
    depth. ``from package import name`` is an edge to ``package.name`` where that is a
    module, else to the package; importing a module is not counted as importing the
    packages above it (their ``__init__`` files are modules of their own)."""
    files = {module_name(p): p for p in module_files()}
    edges: dict[str, dict[str, str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out: dict[str, str] = {}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            where = f"{relative(path)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = alias.name
                    while target and target not in files:
                        target = target.rpartition(".")[0]
                    if target:
                        out.setdefault(target, where)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in files:
                        out.setdefault(sub, where)
                    elif base in files:
                        out.setdefault(base, where)
        out.pop(name, None)
        edges[name] = out
    return edges


def import_circles(edges: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative): each is a set of modules that import one another round a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, targets = work[-1]
            for w in targets:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    return circles


# ----------------------------------------------------------------------------- the tests


def test_every_module_has_a_layer():
    """A new sub-package must be placed in LAYERS before the rule can hold for it."""
    unplaced = sorted(
        {relative(p) for p in checked_files() if layer_of_file(p) not in RANK}
    )  # fmt: skip
    assert not unplaced, "modules of no layer (add their package to LAYERS):\n" + "\n".join(
        unplaced
    )


def test_planning_modules_do_not_import_jax():
    """ir, hardware, intra and inter import no jax, jaxlib, flax or optax, anywhere."""
    violations = [
        str(imp)
        for path in checked_files()
        if layer_of_file(path) in PLANNING
        for imp in imports(path)
        if imp.target.split(".")[0] in JAX_PACKAGES
    ]
    assert not violations, "planning modules importing jax/flax/optax:\n" + "\n".join(violations)


def test_no_module_imports_a_higher_layer():
    """A module imports only from its own layer or lower ones (ALLOWED_ONLY narrows it)."""
    violations = []
    for path in checked_files():
        layer = layer_of_file(path)
        for imp in imports(path):
            target = layer_of_module(imp.target)
            if target is not None and target not in allowed(layer):
                violations.append(f"{imp}   [{layer} -> {target}]")
    assert not violations, "imports against the layer rule:\n" + "\n".join(violations)


def test_importing_the_planning_modules_leaves_jax_out():
    """In a fresh interpreter, importing every planning module loads none of jax's packages."""
    names = [
        module_name(p)
        for p in checked_files()
        if layer_of_file(p) in PLANNING
    ]  # fmt: skip
    code = (
        f"import {', '.join(names)}; import sys; "
        f"print(sorted(m for m in {sorted(JAX_PACKAGES)!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"importing the planning modules failed:\n{out.stderr}"
    assert out.stdout.strip() == "[]", (
        f"importing the planning modules loaded {out.stdout.strip()}; modules: {names}"
    )


def test_no_import_circle():
    """No module of autoshard imports, directly or through others, a module that imports it
    back -- counting imports inside functions and under ``TYPE_CHECKING``."""
    edges = module_edges()
    circles = import_circles(edges)
    report = [
        "circle: "
        + ", ".join(circle)
        + "".join(
            f"\n    {edges[a][b]}: {a} -> {b}" for a in circle for b in edges[a] if b in circle
        )
        for circle in circles
    ]
    assert not circles, "import circles in autoshard/:\n" + "\n".join(report)


def test_the_circle_finder_finds_a_circle():
    """The check above can fail: a three-module circle and a self-contained tail."""
    edges = {"a": {"b": "a:1"}, "b": {"c": "b:1"}, "c": {"a": "c:1", "d": "c:2"}, "d": {}}
    assert import_circles(edges) == [["a", "b", "c"]]
    assert import_circles({"a": {"b": "a:1"}, "b": {}}) == []


def test_intra_is_in_rooms():
    """``autoshard/intra/`` holds sub-packages (rules, memory, cost, ilp, problem, offload,
    baselines), no plain module beside its ``__init__.py``."""
    intra = PACKAGE / "intra"
    loose = sorted(p.name for p in intra.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules directly under autoshard/intra/ (move them into a room): {loose}"
    rooms = [p for p in intra.iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert rooms and all((p / "__init__.py").exists() for p in rooms), rooms
