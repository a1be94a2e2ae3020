"""A new user's first hour (issue 44): ``import scorch`` stays light, ``scorch.explain`` shows its report once,
``help(scorch)`` is a page of scorch rather than torch's 900 names."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str) -> str:
    """``code`` run in a fresh interpreter (nothing imported yet); its standard output."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                       cwd=str(ROOT))  # (this checkout's scorch)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


# --- import: torch.compile's machinery only once it is used ----------------------------------------------------

def test_import_leaves_dynamo_unloaded():
    out = _run("""
        import sys
        import scorch
        heavy = [m for m in ("torch._dynamo", "torch._inductor", "sympy", "scorch.dynamo", "scorch.dynamo_sparse")
                 if m in sys.modules]
        import gc
        print(heavy, gc.isenabled())
    """)
    assert out.strip() == "[] True", out


def test_garbage_collection_paused_only_inside():
    """scorch's import runs without the cyclic collector and gives it back as it was, also when the block raises
    or the collector was off."""
    import gc

    from scorch._forward import no_collection
    assert gc.isenabled()
    with pytest.raises(ZeroDivisionError):
        with no_collection():
            assert not gc.isenabled()
            1 / 0
    assert gc.isenabled()
    gc.disable()
    try:
        with no_collection():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


_PRODUCT = """
    import sys
    import torch as real_torch
    A = scorch.sparse_csr_tensor(real_torch.tensor([0, 2, 3, 3]), real_torch.tensor([0, 2, 1]),
                                 real_torch.tensor([1., 2., 3.]), (3, 3))
    X = real_torch.randn(3, 4)
    expected = A.to_dense() @ X
"""


def test_torch_compile_first_after_import():
    """``torch.compile`` is the first thing run after ``import scorch``: the custom op is registered when Dynamo
    is imported, and the product is one call in one graph."""
    out = _run("import scorch\n" + textwrap.dedent(_PRODUCT) + textwrap.dedent("""
        assert "scorch.dynamo" not in sys.modules
        got = real_torch.compile(lambda a, x: (a @ x).relu(), fullgraph=True, backend="aot_eager")(A, X)
        real_torch.testing.assert_close(got, expected.relu())
        assert "scorch.dynamo" in sys.modules and hasattr(real_torch.ops.scorch, "einsum_dense")
        print("ok")
    """))
    assert out.strip() == "ok"


@pytest.mark.slow
def test_compile_module_under_alias():
    """``import scorch as torch; torch.compile(model)``: a module goes to torch.compile, its sparse product one
    custom op."""
    out = _run("import scorch as torch\nimport scorch\n" + textwrap.dedent(_PRODUCT) + textwrap.dedent("""
        class M(torch.nn.Module):
            def forward(self, a, x):
                return torch.mm(a, x) * 2
        got = torch.compile(M(), fullgraph=True, backend="aot_eager")(A, X)
        real_torch.testing.assert_close(got, expected * 2)
        print("ok")
    """))
    assert out.strip() == "ok"


@pytest.mark.slow
def test_dynamo_imported_before_scorch():
    """``torch._dynamo`` already imported when scorch is: scorch's compile support is loaded at once."""
    out = _run("import torch._dynamo\nimport scorch\n" + textwrap.dedent(_PRODUCT) + textwrap.dedent("""
        assert "scorch.dynamo_sparse" in sys.modules
        got = real_torch.compile(lambda a, x: a @ x, fullgraph=True, backend="aot_eager")(A, X)
        real_torch.testing.assert_close(got, expected)
        print("ok")
    """))
    assert out.strip() == "ok"


def test_dynamo_module_is_torchs_own():
    """The hook that loads scorch's support hands ``torch._dynamo`` its own loader back and leaves the import
    system as it was; a torch function Dynamo's import replaces (``manual_seed``) is torch's new one in scorch."""
    out = _run("""
        import sys
        import scorch
        from scorch import _compile_hook
        assert _compile_hook._FINDER in sys.meta_path
        before = scorch.manual_seed
        import torch._dynamo
        assert scorch.manual_seed is torch.manual_seed and before is not torch.manual_seed
        assert _compile_hook._FINDER not in sys.meta_path
        assert type(torch._dynamo.__spec__.loader).__name__ == "SourceFileLoader", torch._dynamo.__spec__.loader
        assert "scorch.dynamo" in sys.modules and "scorch.dynamo_sparse" in sys.modules
        print("ok")
    """)
    assert out.strip() == "ok"


@pytest.mark.parametrize("first", ["scorch.dynamo_fuse", "scorch.dynamo_sparse", "scorch.dynamo_train",
                                   "scorch.dynamo"])
def test_a_compile_module_imported_first(first):
    """Any of scorch's compile modules imported before ``torch._dynamo`` (the one whose import brings Dynamo in is
    still mid-body when the hook loads the others): no circular import, every module's ops get their direct CPU
    kernels once it has run to its end, the pre-grad passes in their order, and a compiled sparse Linear runs."""
    out = _run(f"""
        import importlib
        importlib.import_module("{first}")
        import torch, torch._dynamo
        import scorch
        from scorch import _compile_hook
        from torch._inductor import config
        from torch._inductor.custom_graph_pass import get_custom_graph_passes
        names = ["scorch.dynamo", "scorch.dynamo_fuse", "scorch.dynamo_sparse", "scorch.dynamo_train"]
        assert sorted(_compile_hook._registered) == names, _compile_hook._registered
        passes = [type(p).__name__ for p in get_custom_graph_passes(config.pre_grad_custom_pass)]
        assert passes.index("TrainingPass") < passes.index("EpiloguePass"), passes
        lin = torch.nn.Linear(16, 8)
        lin.weight = torch.nn.Parameter(scorch.asformat(lin.weight.detach() * (torch.rand(8, 16) < 0.3), "csr"))
        x = torch.randn(5, 16)
        with torch.no_grad():
            want = torch.nn.functional.linear(x, lin.weight.to_dense(), lin.bias)
            got = torch.compile(lin, fullgraph=True)(x)
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        print("ok")
    """)
    assert out.strip() == "ok"


# --- scorch.explain: one report, returned, printed only where asked --------------------------------------------

def _spmm():
    import torch

    import scorch
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(12, 10, generator=g).relu()
    return scorch.asformat(dense, "csr"), torch.randn(10, 5, generator=g)


def test_explain_returns_without_printing(capsys):
    import scorch
    s, x = _spmm()
    e = scorch.explain("ij,jk->ik", s, x)
    assert capsys.readouterr().out == ""
    assert isinstance(e, str) and e.startswith("expression:")
    assert repr(e) == str(e).rstrip("\n") and not repr(e).startswith("'")  # the REPL's echo: the report, as text
    print(e)
    assert capsys.readouterr().out.count("expression:") == 1


def test_explain_leaves_the_source_out_by_default():
    import scorch
    s, x = _spmm()
    short, full = scorch.explain("ij,jk->ik", s, x), scorch.explain("ij,jk->ik", s, x, source=True)
    assert "#include" not in short and "source=True" in short
    assert "#include" in full and len(full.splitlines()) > len(short.splitlines()) + 20
    assert "#include" in short.source and short.source == full.source
    for e in (short, full):  # the plans behind the report either way
        assert len(e.plans) == 1 and e.schedule is not None
        assert e.directives.order == tuple("ijk") and e.schedule == e.plans[0].schedule


def test_explain_writes_to_a_given_file_once(capsys):
    import io

    import scorch
    s, x = _spmm()
    buf = io.StringIO()
    e = scorch.explain("ij,jk->ik", s, x, file=buf)
    assert buf.getvalue() == e and capsys.readouterr().out == ""


def test_explain_of_dense_operands_says_so():
    import torch

    import scorch
    e = scorch.explain("ij,jk->ik", torch.randn(3, 4), torch.randn(4, 2))
    assert e.plans == () and e.schedule is None and e.directives is None and e.source == ""
    assert "dense" in e


# --- help(scorch), __all__, dir(scorch) -------------------------------------------------------------------------

def test_all_lists_scorchs_own_public_names():
    """``__all__`` is scorch's API: every public non-module name its ``__init__`` defines, nothing of torch's
    forwarding (read in a fresh process: a forwarded name read once is kept in the module's dict)."""
    out = _run("""
        import inspect, scorch
        own = {k for k, v in vars(scorch).items() if not k.startswith("_") and not inspect.ismodule(v)}
        print(sorted(own ^ set(scorch.__all__) - {"nn", "sparse", "formats"}))
        print(len(scorch.__all__) == len(set(scorch.__all__)))
    """)
    assert out.split("\n")[:2] == ["[]", "True"], out


def test_star_import_takes_scorchs_names_and_torch_names_still_resolve():
    import torch

    import scorch
    ns = {}
    exec("from scorch import *", ns)
    assert set(ns) - {"__builtins__"} == set(scorch.__all__)
    assert ns["einsum"] is scorch.einsum and ns["SparseTensor"] is scorch.SparseTensor and "zeros" not in ns
    import scorch as torch_alias
    assert torch_alias.zeros is torch.zeros and torch_alias.nn.Linear is torch.nn.Linear
    assert {"zeros", "einsum", "SparseTensor", "save_portable"} <= set(dir(scorch))  # completion sees both


def test_help_is_a_page_of_scorch():
    import pydoc

    import scorch
    text = pydoc.render_doc(scorch, renderer=pydoc.plaintext)
    head = "\n".join(text.splitlines()[:60])
    for entry in ("asformat", "einsum", "explain", "schedule(model)", "compile", "stats()", "save_portable"):
        assert entry in head, entry
    # the one long part is SparseTensor's: torch.Tensor's ~4,900 methods and properties it inherits
    start = text.index("\n    class SparseTensor")
    end = text.index("\n    class ", start + 1)
    assert len(text.splitlines()) < 6500 and len((text[:start] + text[end:]).splitlines()) < 1000
    assert "zeros_like" not in text[:start] + text[end:]  # none of torch's 900 names listed
    assert len(scorch.__doc__.splitlines()) < 45
