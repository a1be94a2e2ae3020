"""Package structure check (issue 18): layering, import cycles and module size, read statically.

``python tools/structure.py`` reads every ``scorch/**/*.py`` with :mod:`ast` (no scorch code runs) and collects
every import, at module level and inside functions, methods, conditionals and ``try`` blocks. It reports:

1. Layering: a module under a package of :data:`LAYERS` imports only the packages that table allows it.
2. Cycles: every strongly connected component of more than one module in the import graph (Tarjan), with the
   import edges inside it.
3. Size: every module of more than :data:`MAX_LINES` lines.

Today's code breaks all three, so the check is a ratchet: ``tools/structure-baseline.txt`` lists the accepted
violations (stable text, no line numbers). The exit status is 1 only for a violation not in the baseline; a
baseline entry no longer violated is printed as fixed. ``--update-baseline`` rewrites the baseline to the
current violations, and only shrinks it unless ``--force``. ``--graph`` prints the package-level matrix.

How an import resolves to a module (the convention of grimp / import-linter):

- ``import a.b.c`` depends on ``a.b.c`` (the longest prefix that is a module of the tree), not on ``a`` or
  ``a.b``, although Python runs their ``__init__`` first: counting those would put every module that imports a
  submodule of ``scorch`` into one cycle with ``scorch/__init__.py``, which imports everything.
- ``from P import n`` depends on ``P.n`` where that is a module (a submodule file or package), otherwise on
  ``P`` itself; a package stands for its ``__init__``. ``from P import *`` depends on ``P``.
- Relative imports resolve against the importing module's package (a package's ``__init__`` is its own).
- Imports of modules outside the package, and dynamic imports (``importlib.import_module(name)``), are not
  counted. An absolute import of a name under the package that names no module is reported as unresolved.
"""
from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "scorch"
MAX_LINES = 700
# Where the loop IR lives: scorch/loopir.py, a leaf (it was scorch/compiler/loops.py). It may become a package
# ("scorch.loopir", "scorch.ir"): name that here.
LOOP_IR = ("scorch.loopir",)
# A package or module -> the packages (or modules) it may import. A module follows the longest key that contains
# it; modules no key contains are not constrained. Later layers (e.g. "scorch.engine") get a row here.
LAYERS: dict[str, tuple[str, ...]] = {
    "scorch.compiler": ("scorch.compiler", "scorch.formats", *LOOP_IR),
    # the execution layer: tensors (sparse_tensor, and interop's constructors) meet compiled plans; autograd,
    # deferral and fusion sit above it and register themselves
    "scorch.engine": ("scorch.engine", "scorch.compiler", "scorch.formats", *LOOP_IR, "scorch.sparse_tensor",
                      "scorch._stats", "scorch.rules"),
    # the tensor type: above formats, below the engine (what it hands up goes through scorch.rules)
    "scorch.sparse_tensor": ("scorch.sparse_tensor", "scorch.formats", *LOOP_IR, "scorch._stats", "scorch.rules",
                             "scorch._traceable"),
    # SparseTensor's mixin for torch.compile's subclass tracing (__tensor_flatten__...): beside it, above formats
    "scorch._traceable": ("scorch._traceable", "scorch.formats", "scorch.rules", *LOOP_IR),
    "scorch.rules": ("scorch.rules",),  # the rule table the upper layers fill: a leaf
    "scorch.unary_maps": ("scorch.unary_maps",),  # one record per unary map, read by every layer: a leaf
    **{ir: LOOP_IR for ir in LOOP_IR},  # the loop IR is a leaf: it imports nothing else of scorch
}

REPO = Path(__file__).resolve().parent.parent
BASELINE = Path(__file__).resolve().parent / "structure-baseline.txt"


@dataclass
class Module:
    name: str
    path: Path       # the file
    rel: str         # the file relative to the root, with "/" (stable text for reports and the baseline)
    is_package: bool
    lines: int


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    line: int
    in_function: bool


@dataclass
class Project:
    modules: dict[str, Module]
    imports: list[Import]                               # one per resolved (statement, target module)
    unresolved: list[tuple[str, int, str]] = field(default_factory=list)  # (importer, line, dotted name)

    def edges(self) -> dict[tuple[str, str], list[Import]]:
        """(importer, target) -> the import statements behind it; a module's import of itself is left out."""
        out: dict[tuple[str, str], list[Import]] = defaultdict(list)
        for imp in self.imports:
            if imp.importer != imp.target:
                out[imp.importer, imp.target].append(imp)
        return dict(out)

    def where(self, imports: list[Import]) -> str:
        """``path:line, line, ...`` for imports of one module (the importer's file)."""
        rel = self.modules[imports[0].importer].rel
        lines = sorted({i.line for i in imports})
        return f"{rel}:" + ",".join(str(n) for n in lines)


# --- reading ---------------------------------------------------------------------------------------------------

def scan(root: Path, package: str = PACKAGE) -> Project:
    """The modules under ``root/package`` and their imports of each other."""
    root = Path(root)
    modules: dict[str, Module] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        text = path.read_text(encoding="utf-8")
        modules[name] = Module(name, path, path.relative_to(root).as_posix(), is_package, len(text.splitlines()))
    project = Project(modules, [])
    for mod in modules.values():
        tree = ast.parse(mod.path.read_text(encoding="utf-8"), filename=str(mod.path))
        _Collector(project, mod, package).visit(tree)
    return project


class _Collector(ast.NodeVisitor):
    def __init__(self, project: Project, module: Module, package: str):
        self.project, self.module, self.package = project, module, package
        self.depth = 0  # function nesting

    def _function(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _add(self, target: str, line: int) -> None:
        self.project.imports.append(Import(self.module.name, target, line, self.depth > 0))

    def _ours(self, dotted: str) -> bool:
        return dotted == self.package or dotted.startswith(self.package + ".")

    def _longest_module(self, dotted: str, line: int) -> None:
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in self.project.modules:
                if n < len(parts):  # names something that is not a module file: note it, depend on the prefix
                    self.project.unresolved.append((self.module.name, line, dotted))
                self._add(".".join(parts[:n]), line)
                return
        self.project.unresolved.append((self.module.name, line, dotted))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if self._ours(alias.name):
                self._longest_module(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = resolve_from(self.module.name, self.module.is_package, node.module, node.level)
        if base is None:
            self.project.unresolved.append((self.module.name, node.lineno, "." * node.level + (node.module or "")))
            return
        if not self._ours(base):
            return
        subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in self.project.modules]
        for sub in subs:
            self._add(sub, node.lineno)
        if len(subs) < len(node.names):  # a name that is no module (or "*"): the package or module ``base``
            self._longest_module(base, node.lineno)


def resolve_from(module: str, is_package: bool, name: str | None, level: int) -> str | None:
    """The absolute dotted name that ``from <"." * level><name> import ...`` in ``module`` names (``None``
    where the relative import climbs above the top package)."""
    if level == 0:
        return name
    parts = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 > len(parts) - 1:
        return None
    parts = parts[:len(parts) - (level - 1)]
    return ".".join(parts + ([name] if name else []))


# --- graph -----------------------------------------------------------------------------------------------------

def strongly_connected(nodes, succ: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted; components in reverse topological
    order of the condensation."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(succ.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(succ.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                out.append(sorted(comp))
    return out


def shortest_cycle(start: str, succ: dict[str, set[str]], within: set[str]) -> list[str]:
    """A shortest import cycle through ``start`` inside ``within`` (breadth-first), as ``[start, ..., start]``."""
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(succ.get(node, ())):
                if child not in within:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if child not in prev:
                    prev[child] = node
                    nxt.append(child)
        frontier = nxt
    return [start]


def successors(project: Project) -> dict[str, set[str]]:
    succ: dict[str, set[str]] = defaultdict(set)
    for importer, target in project.edges():
        succ[importer].add(target)
    return succ


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(module: str, layers: dict[str, tuple[str, ...]]) -> str | None:
    keys = [k for k in layers if _within(module, k)]
    return max(keys, key=len) if keys else None


# --- checks ----------------------------------------------------------------------------------------------------

@dataclass
class Violation:
    key: str            # the stable text the baseline holds
    detail: list[str]   # report lines (with file:line)


def check(project: Project, layers: dict[str, tuple[str, ...]] = LAYERS, max_lines: int = MAX_LINES):
    """(layering, cycles, sizes, components): the violations of each rule, and the multi-module SCCs."""
    edges = project.edges()
    layering = []
    for (importer, target), imps in sorted(edges.items()):
        layer = layer_of(importer, layers)
        if layer is not None and not any(_within(target, ok) for ok in layers[layer]):
            layering.append(Violation(f"layer {importer} -> {target}", [project.where(imps)]))
    succ = successors(project)
    components = [c for c in strongly_connected(project.modules, succ) if len(c) > 1]
    components.sort(key=lambda c: (-len(c), c))
    cycles = []
    for comp in components:  # the component's report goes with its first member
        members = set(comp)
        inside = [(a, b) for (a, b) in sorted(edges) if a in members and b in members]
        detail = _component_report(project, comp, succ, inside, edges)
        cycles += [Violation(f"cycle-member {m}", detail if i == 0 else []) for i, m in enumerate(comp)]
    sizes = [Violation(f"size {m.rel}", [f"{m.rel}: {m.lines} lines > {max_lines}"])
             for m in sorted(project.modules.values(), key=lambda m: m.rel) if m.lines > max_lines]
    return layering, cycles, sizes, components


def _component_report(project, comp, succ, inside, edges) -> list[str]:
    cycle = shortest_cycle(comp[0], succ, set(comp))
    lines = [f"component of {len(comp)} modules, {len(inside)} import edges: {', '.join(comp)}",
             f"  e.g. {' -> '.join(cycle)}"]
    lines += [f"  {a} -> {b}  ({project.where(edges[a, b])}"
              f"{', in a function' if all(i.in_function for i in edges[a, b]) else ''})" for a, b in inside]
    return lines


def read_baseline(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [s for s in (line.split("#", 1)[0].strip() for line in path.read_text().splitlines()) if s]


def write_baseline(path: Path, keys: list[str]) -> None:
    head = ("# Accepted structure violations (tools/structure.py): a line each; the check fails only on one not\n"
            "# listed here. Shrink it as violations are fixed: python tools/structure.py --update-baseline\n")
    path.write_text(head + "".join(f"{k}\n" for k in sorted(keys)))


# --- package matrix --------------------------------------------------------------------------------------------

def unit_of(module: str, subpackages: set[str]) -> str:
    """The top-level subpackage a module belongs to; the package's own top-level modules are one unit."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and ".".join(parts[:2]) in subpackages else "(top)"


def package_matrix(project: Project, package: str = PACKAGE) -> str:
    subpackages = {m.name for m in project.modules.values() if m.is_package}
    counts: dict[tuple[str, str], int] = defaultdict(int)
    units = sorted({unit_of(m, subpackages) for m in project.modules})
    for importer, target in project.edges():
        a, b = unit_of(importer, subpackages), unit_of(target, subpackages)
        if a != b:
            counts[a, b] += 1
    width = max(len(u) for u in units) + 1
    out = [f"package-level imports of {package} (row imports column; a cell counts module-to-module edges;",
           f"(top) is {package}/*.py):", " " * width + "".join(u.rjust(width) for u in units)]
    for a in units:
        out.append(a.ljust(width) + "".join((str(counts[a, b]) if counts[a, b] else ".").rjust(width)
                                            for b in units))
    return "\n".join(out)


# --- main ------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=REPO, help="the directory holding the package (default: the repo)")
    ap.add_argument("--baseline", type=Path, default=BASELINE)
    ap.add_argument("--update-baseline", action="store_true", help="rewrite the baseline to today's violations")
    ap.add_argument("--force", action="store_true", help="with --update-baseline: let the baseline grow")
    ap.add_argument("--graph", action="store_true", help="print the package-level dependency matrix")
    ap.add_argument("--quiet", action="store_true", help="print only new violations, fixed entries and the summary")
    args = ap.parse_args(argv)

    project = scan(args.root)
    layering, cycles, sizes, components = check(project)
    baseline = read_baseline(args.baseline)
    known = set(baseline)
    current = [v.key for v in (*layering, *cycles, *sizes)]
    new = [k for k in current if k not in known]

    def section(title: str, violations: list[Violation]) -> None:
        if not args.quiet:
            print(f"== {title}: {len(violations)}")
        for v in violations:
            if v.key in known and args.quiet:
                continue
            print(f"  [{'baseline' if v.key in known else 'new'}] {v.key}")
            for line in v.detail:
                print(f"      {line}")

    rules = ", ".join(f"{k} may import {' '.join(v)}" for k, v in LAYERS.items())
    section(f"layering ({rules})", layering)
    section("import cycles (modules in a strongly connected component)", cycles)
    section(f"modules over {MAX_LINES} lines", sizes)
    for importer, line, dotted in project.unresolved:
        print(f"unresolved: {project.modules[importer].rel}:{line} imports {dotted}")
    if args.graph:
        print(package_matrix(project))

    fixed = [k for k in baseline if k not in set(current)]
    for k in fixed:
        print(f"fixed: {k}: remove it from the baseline (python tools/structure.py --update-baseline)")
    edges = project.edges()
    print(f"summary: {len(project.modules)} modules, {len(edges)} import edges "
          f"({len(project.imports)} imports, {sum(i.in_function for i in project.imports)} inside functions), "
          f"{sum(map(len, components))} modules in cycles ({len(components)} components, largest "
          f"{max(map(len, components), default=0)}), {len(layering)} layering violations, "
          f"{len(sizes)} modules over {MAX_LINES} lines; {len(new)} new, {len(fixed)} fixed against the baseline")

    if args.update_baseline:
        if new and not args.force:
            print(f"refused: the baseline would grow by {len(new)} (fix them, or --force)", file=sys.stderr)
            return 1
        write_baseline(args.baseline, current)
        print(f"baseline rewritten: {len(current)} entries ({args.baseline})")
        return 0
    if new:
        print(f"structure: {len(new)} violation(s) not in the baseline:", file=sys.stderr)
        for k in new:
            print(f"  {k}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
