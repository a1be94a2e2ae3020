"""The torch versions scorch runs on, checked at import."""
from __future__ import annotations

#: the oldest torch scorch runs on: torch.compile of SparseTensors needs 2.13's Dynamo (2.12 refuses to wrap the
#: tensor, "Attempted to wrap sparse Tensor"; 2.11 resumed inside ``SparseTensor.__new__``), and the suite is run on
#: 2.13, 2.14 and 2.15 (docs/compile.md); pyproject.toml requires the same
MIN_TORCH = (2, 13)


def release(version: str) -> tuple:
    """``(major, minor)`` of a torch version string (``"2.14.1+cu130"``, ``"3.0.0a0+git1234"``)."""
    parts = version.split("+")[0].split(".")
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts[:2])


def check_torch(version: str) -> None:
    """Refuse a torch older than ``MIN_TORCH`` at import, naming both versions (not an obscure failure later)."""
    if release(version) < MIN_TORCH:
        raise ImportError(f"scorch needs torch >= {'.'.join(map(str, MIN_TORCH))}, found torch {version}: upgrade "
                          "it (the CPU build: pip install torch --index-url https://download.pytorch.org/whl/cpu)")
