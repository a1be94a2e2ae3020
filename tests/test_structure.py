"""tools/structure.py: the package's structure has no violation beyond its baseline, and the checker's reading
of imports and its cycle finder, on small synthetic packages."""
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "tools" / "structure.py"


@pytest.fixture(scope="module")
def structure():
    spec = importlib.util.spec_from_file_location("_scorch_structure", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def _tree(root: Path, files: dict) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def _edges(project) -> set:
    return set(project.edges())


def test_no_new_violations(structure, capsys):
    assert structure.main(["--quiet"]) == 0, capsys.readouterr().err


def test_relative_imports_and_imports_in_functions(structure, tmp_path):
    root = _tree(tmp_path, {
        "pkg/__init__.py": "from . import a\nfrom .sub import Thing\n",
        "pkg/a.py": """
            import os
            from .sub import c as c_module, Thing
            def f():
                from . import b
                if True:
                    try:
                        import pkg.sub.c
                    except ImportError:
                        pass
            """,
        "pkg/b.py": "class B:\n    def m(self):\n        from .sub.c import x\n",
        "pkg/sub/__init__.py": "from .. import b\nThing = 1\n",
        "pkg/sub/c.py": "from .. import a\n",
    })
    project = structure.scan(root, "pkg")
    assert set(project.modules) == {"pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c"}
    assert _edges(project) == {
        ("pkg", "pkg.a"), ("pkg", "pkg.sub"),              # a package's own relative imports
        ("pkg.a", "pkg.sub.c"), ("pkg.a", "pkg.sub"),      # a submodule, and a name of the package
        ("pkg.a", "pkg.b"),                                # inside a function
        ("pkg.b", "pkg.sub.c"), ("pkg.sub", "pkg.b"), ("pkg.sub.c", "pkg.a"),
    }
    nested = {(i.importer, i.target): i.in_function for i in project.imports}
    assert nested["pkg.a", "pkg.b"] and nested["pkg.b", "pkg.sub.c"] and not nested["pkg.sub", "pkg.b"]
    assert [(i.line, i.in_function) for i in project.imports if i.target == "pkg.sub.c" and i.importer == "pkg.a"] \
        == [(3, False), (8, True)]
    assert project.unresolved == []


def test_resolve_from(structure):
    r = structure.resolve_from
    assert r("pkg.sub.c", False, None, 1) == "pkg.sub"
    assert r("pkg.sub", True, None, 1) == "pkg.sub"          # a package's __init__ is its own package
    assert r("pkg.sub.c", False, "formats", 2) == "pkg.formats"
    assert r("pkg.a", False, "x.y", 0) == "x.y"
    assert r("pkg.a", False, None, 3) is None                # above the top package


def test_three_cycle_and_package_init(structure, tmp_path):
    root = _tree(tmp_path, {
        "pkg/__init__.py": "from .x import X\n",             # the package depends on x; nothing imports pkg
        "pkg/x.py": "from . import y\n",
        "pkg/y.py": "def f():\n    from .z import g\n",
        "pkg/z.py": "import pkg.x\nfrom pkg import w\n",
        "pkg/w.py": "import pkg\n",                        # w -> pkg (its __init__) -> x -> y -> z -> w
        "pkg/leaf.py": "",
    })
    project = structure.scan(root, "pkg")
    succ = structure.successors(project)
    sccs = [c for c in structure.strongly_connected(project.modules, succ) if len(c) > 1]
    assert sccs == [["pkg", "pkg.w", "pkg.x", "pkg.y", "pkg.z"]]
    assert structure.shortest_cycle("pkg.x", succ, set(sccs[0])) == ["pkg.x", "pkg.y", "pkg.z", "pkg.x"]
    # without w's import of the package, the 3-cycle x -> y -> z -> x stands alone
    (root / "pkg" / "w.py").write_text("")
    project = structure.scan(root, "pkg")
    layering, cycles, sizes, components = structure.check(project, layers={}, max_lines=1)
    assert components == [["pkg.x", "pkg.y", "pkg.z"]]
    assert [v.key for v in cycles] == ["cycle-member pkg.x", "cycle-member pkg.y", "cycle-member pkg.z"]
    assert "pkg.y -> pkg.z  (pkg/y.py:2, in a function)" in "\n".join(cycles[0].detail)
    assert [v.key for v in sizes] == ["size pkg/y.py", "size pkg/z.py"]


def test_layers_and_baseline(structure, tmp_path):
    root = _tree(tmp_path / "src", {
        "pkg/__init__.py": "",
        "pkg/top.py": "",
        "pkg/ir.py": "from . import top\n",
        "pkg/core/__init__.py": "",
        "pkg/core/a.py": "from .. import ir, top\nfrom ..fmt import f\n",
        "pkg/fmt/__init__.py": "",
        "pkg/fmt/f.py": "",
    })
    layers = {"pkg.core": ("pkg.core", "pkg.fmt", "pkg.ir"), "pkg.ir": ("pkg.ir",)}
    layering, _, _, _ = structure.check(structure.scan(root, "pkg"), layers=layers)
    assert [(v.key, v.detail) for v in layering] == [
        ("layer pkg.core.a -> pkg.top", ["pkg/core/a.py:1"]), ("layer pkg.ir -> pkg.top", ["pkg/ir.py:1"])]
    baseline = tmp_path / "baseline.txt"
    structure.write_baseline(baseline, ["size b", "layer a -> b"])
    assert structure.read_baseline(baseline) == ["layer a -> b", "size b"]
