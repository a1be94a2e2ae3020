"""``import scorch as torch``: torch's names are torch's own objects; submodules import the way torch's do."""
import importlib
import re
import subprocess
import sys

import pytest
import torch

import scorch
from scorch._versions import MIN_TORCH, check_torch

NAMES = """
tensor randn rand zeros ones empty full arange linspace eye zeros_like ones_like randn_like rand_like randint
randperm manual_seed from_numpy as_tensor cat stack split chunk reshape transpose permute squeeze unsqueeze
flatten gather scatter index_select masked_select where clamp abs exp log sqrt sin cos tanh sigmoid relu
softmax log_softmax matmul mm bmm mv addmm sum mean max min amax amin argmax argmin topk sort norm
allclose equal isclose no_grad enable_grad set_grad_enabled inference_mode is_tensor is_grad_enabled
float32 float64 float16 bfloat16 int64 int32 int16 int8 uint8 bool complex64 strided sparse_coo sparse_csr
sparse_csc sparse_bsr sparse_bsc device dtype layout Size Tensor Generator float double long int half
get_default_dtype set_default_dtype from_dlpack cumsum cumprod diff flip roll tril triu outer kron cdist
optim autograd utils linalg fft special distributions jit cuda backends testing save load
""".split()
# the functions of torch that take tensors (torch's overridable functions): scorch wraps these
TENSOR_FUNCTIONS = frozenset(id(f) for f in torch.overrides.get_overridable_functions().get(torch, ()))


@pytest.mark.parametrize("name", NAMES)
def test_forwarded_names_are_torch_objects(name):
    """torch's own object; for a function that takes tensors, torch's function run again with torch's sparse
    layouts viewed as SparseTensors where torch refuses them (a wrapper of torch's function, one per name)."""
    ours, theirs = getattr(scorch, name), getattr(torch, name)
    if id(theirs) in TENSOR_FUNCTIONS:
        assert ours is not theirs and ours.__wrapped__ is theirs and ours.__qualname__ == name
        assert ours.__module__ == "scorch" and ours is getattr(scorch, name)  # cached: one wrapper per name
    else:
        assert ours is theirs


def test_at_least_100_names_checked():
    assert len(set(NAMES)) >= 100


def test_submodule_imports_work_like_torch():
    import scorch.nn as nn
    from scorch.nn import functional as F
    from scorch.optim import Adam
    from scorch.utils.data import DataLoader, TensorDataset
    assert nn.Linear is torch.nn.Linear and nn.Module is torch.nn.Module
    assert F.relu.__wrapped__ is torch.nn.functional.relu and F.softmax.__wrapped__ is torch.nn.functional.softmax
    assert Adam is torch.optim.Adam and DataLoader is torch.utils.data.DataLoader
    assert TensorDataset is torch.utils.data.TensorDataset
    for sub in ("optim", "linalg", "autograd", "utils.data", "nn.init", "nn.utils", "distributions"):
        assert importlib.import_module("scorch." + sub) is importlib.import_module("torch." + sub), sub
    # torch's modules keep their own identity
    assert torch.utils.data.__spec__.name == "torch.utils.data" and torch.nn.init.__name__ == "torch.nn.init"


def test_scorch_modules_are_its_own():
    import scorch.nn
    import scorch.nn.functional
    import scorch.sparse
    assert scorch.nn is not torch.nn and scorch.sparse is not torch.sparse
    assert scorch.sparse.spdiags is torch.sparse.spdiags  # forwarded: scorch does not override it
    assert scorch.sparse.softmax is not torch.sparse.softmax  # overridden: torch's sparse layouts run in scorch
    assert callable(scorch.sparse.check_invariants)
    assert scorch.sparse_csr_tensor is not torch.sparse_csr_tensor  # scorch's constructors return SparseTensors
    assert scorch.einsum is not torch.einsum  # takes format= and runs sparse operands through the compiler


def test_dir_lists_torch_and_scorch_names():
    names = dir(scorch)
    assert {"randn", "nn", "SparseTensor", "asformat", "Format"} <= set(names)
    assert "Linear" in dir(scorch.nn) and "relu" in dir(scorch.nn.functional)


def test_missing_names_raise_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'definitely_not_a_torch_name'"):
        scorch.definitely_not_a_torch_name
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("scorch.definitely_not_a_module")


def test_dense_code_is_not_wrapped():
    x = scorch.randn(3, 3)
    y = scorch.nn.functional.relu(x @ x)
    assert type(x) is torch.Tensor and type(y) is torch.Tensor


def test_drop_in_script_runs_unchanged():
    code = """
import scorch as torch
import scorch.nn as nn
from scorch.nn import functional as F
from scorch.optim import SGD
from scorch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
x = torch.randn(64, 4); y = (x.sum(1) > 0).long()
model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
opt = SGD(model.parameters(), lr=0.5)
for xb, yb in DataLoader(TensorDataset(x, y), batch_size=16):
    loss = F.cross_entropy(model(xb), yb); opt.zero_grad(); loss.backward(); opt.step()
print(type(loss).__module__, float(loss) >= 0)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["torch", "True"]


def test_torch_sparse_layouts_reaching_scorch_functions_run_in_scorch():
    import scorch.nn.functional as F
    x = torch.tensor([[0.0, 2.0, 0.0], [3.0, 0.0, 4.0]])
    for t in (x.to_sparse(), x.to_sparse_csr()):
        scorch.reset_stats()  # pad warns once per op: again for each layout
        r = scorch.reshape(t, (6,))
        assert isinstance(r, scorch.SparseTensor) and torch.equal(r.to_dense(), x.reshape(6))
        padded = F.pad(t, (1, 1))  # (zeros: sparse)
        assert isinstance(padded, scorch.SparseTensor)
        assert torch.equal(padded.to_dense(), torch.nn.functional.pad(x, (1, 1)))
        with pytest.warns(scorch.DensifyWarning, match="pad"):  # (a nonzero value: the dense form)
            assert torch.equal(F.pad(t, (1, 1), value=1.0), torch.nn.functional.pad(x, (1, 1), value=1.0))
        assert torch.equal(scorch.cat([t, t]).to_dense(), torch.cat([x, x]))
        assert torch.equal(scorch.unbind(t, 1)[2].to_dense(), x[:, 2])
    with pytest.raises(RuntimeError, match="size"):
        scorch.reshape(torch.ones(2, 3), (7,))  # dense: torch's own error, raised once


def test_routed_functions_pickle_and_script_as_torchs():
    import pickle

    import scorch.nn.functional as F
    assert pickle.loads(pickle.dumps(scorch.relu)) is scorch.relu
    assert pickle.loads(pickle.dumps(F.gelu)) is F.gelu
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.act = F.gelu  # a module holding a function: torch.save pickles it
    assert pickle.loads(pickle.dumps(model)).act is F.gelu

    @scorch.jit.script
    def f(x):
        return scorch.relu(x) + F.pad(x, (0, 0)) + scorch.cat([x, x])[:2]
    assert torch.equal(f(torch.ones(2)), torch.full((2,), 3.0))


def test_routed_names_resolve_when_torch_is_aliased_to_scorch_in_sys_modules():
    """Code that aliases ``sys.modules["torch"]`` to scorch (as the drop-in tests do) then reads names: the set of
    functions to wrap was read from torch's own modules at import, not under the alias (recursion before)."""
    code = ("import sys, scorch\nsys.modules['torch'] = scorch\nimport torch\n"
            "from torch import cat\nimport torch.nn.functional as F\n"
            "print(cat.__wrapped__.__module__, F is scorch.nn.functional or F.relu.__wrapped__.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == "torch"


def test_torch_ops_under_the_alias_is_torchs():
    """``scorch.ops`` is scorch's package of sparse rules, and under ``import scorch as torch`` also
    ``torch.ops``: the operator namespaces are torch's (``torch.ops.aten.add`` raised AttributeError)."""
    import scorch
    assert scorch.ops.aten is torch.ops.aten
    assert torch.equal(scorch.ops.aten.add.Tensor(torch.ones(2), torch.ones(2)), torch.full((2,), 2.))
    assert scorch.ops.load_library == torch.ops.load_library


def test_torch_submodules_import_where_torch_is_scorch_in_sys_modules():
    """Code that puts scorch in ``sys.modules['torch']`` (loading a package with torch replaced) still imports
    torch's submodules that were not imported yet (``import torch._dynamo`` raised ModuleNotFoundError)."""
    import subprocess
    import sys
    code = ("import sys, scorch\nsys.modules['torch'] = scorch\nimport torch._dynamo, torch.utils.checkpoint\n"
            "assert sys.modules['torch'] is scorch and torch._dynamo.__name__ == 'torch._dynamo'\n"
            "try:\n    import torch.no_such_module\nexcept ImportError:\n    print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("version, refused", [("2.12.1+cu130", True), ("2.4.0", True), ("1.13.1", True),
                                              ("2.13.0+cpu", False), ("2.14.1", False), ("2.15.0", False),
                                              ("3.0.0a0+git1234", False)])
def test_old_torch_refused_at_import(version, refused):
    """torch older than 2.13 (where torch.compile of SparseTensors fails inside Dynamo) is refused at import with
    a message naming both versions; newer ones pass."""
    if refused:
        with pytest.raises(ImportError, match=r"scorch needs torch >= 2\.13, found torch " + re.escape(version)):
            check_torch(version)
    else:
        check_torch(version)


def test_pyproject_requires_what_import_checks():
    import pathlib
    text = (pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '"torch>=' + ".".join(map(str, MIN_TORCH)) + '"' in text
