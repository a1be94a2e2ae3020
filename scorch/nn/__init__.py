"""``scorch.nn``: torch.nn, with scorch's sparse-aware additions. Other names are torch.nn's own."""
import torch.nn as _nn

from .. import _forward
from . import functional  # noqa: F401
from .sparsify import (NM, BlockFraction, KeepAll, RandomFraction, ScalarFraction, ScalarThreshold,  # noqa: F401
                       Sparsifier)
from .schedule import Schedule, storage_bytes  # noqa: F401
from .sparsified import SparsifiedOp, Spec, sparsified_op  # noqa: F401
from .layers import SparseLinear, patch_model, reformat_model  # noqa: F401
from . import distributed  # noqa: E402

distributed.install()  # torch's DistributedDataParallel trains SparseTensor parameters (issue 21)

__getattr__, __dir__ = _forward.forward(globals(), _nn)
