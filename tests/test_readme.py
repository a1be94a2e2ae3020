"""The README's example runs verbatim, as a new user would paste it."""
import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_example_runs_verbatim():
    code = python_blocks()[0]
    assert len([line for line in code.splitlines() if line.strip()]) <= 10
    out = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "SparseTensor(format=csr, shape=(6, 8)" in out.stdout and "bsr(2, 4)" in out.stdout


def test_readme_ops_example_runs_after_the_first():
    blocks = python_blocks()
    ops = next(b for b in blocks if "sampled_addmm" in b)
    out = subprocess.run([sys.executable, "-c", blocks[0] + ops], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "loop order:" in out.stdout and "source=True" in out.stdout  # (the report, once; its source left out)
    assert out.stdout.count("loop order:") == 1


def test_readme_format_examples_hold():
    block = next(b for b in python_blocks() if "scorch.Format(" in b and "->" in b and "asformat" not in b)
    code = "import scorch\n" + block.replace("scorch.Format(", "f = scorch.Format(")
    code = code.replace("# == scorch.formats.dia", "\nassert f == scorch.formats.dia")
    code = code.replace("# == scorch.formats.coo", "\nassert f == scorch.formats.coo")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_readme_training_example_runs_after_the_first():
    blocks = python_blocks()
    train = next(b for b in blocks if "loss.backward()" in b)
    out = subprocess.run([sys.executable, "-c", blocks[0] + train], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].split() == ["csr", "csr"]


def test_sparse_api_doc_is_in_sync_with_the_registry():
    from scorch import catalog
    doc = README.parent / "docs" / "sparse-api.md"
    assert doc.read_text() == catalog.markdown(), "regenerate: python -m scorch.catalog > docs/sparse-api.md"


def test_readme_sparsify_example_runs():
    block = next(b for b in python_blocks() if "scorch.schedule(model)" in b)
    out = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "bsr(16, 16)" in out.stdout and "csr" in out.stdout


def test_readme_gpu_example():
    """On a GPU the example runs verbatim; without one it runs with the device moves taken out (the CPU path of
    the same code), so it stays valid."""
    import torch
    block = next(b for b in python_blocks() if ".cuda()" in b)
    if not torch.cuda.is_available():
        block = block.replace(".cuda()", "").replace(', device="cuda"', "")
    out = subprocess.run([sys.executable, "-c", "import torch, scorch\n" + block], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert ("target:       CUDA" in out.stdout) == torch.cuda.is_available()
