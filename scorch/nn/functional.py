"""``scorch.nn.functional``: torch.nn.functional's functions. A sparse operand reaches scorch through
``SparseTensor.__torch_function__``, so the functions themselves are torch's own objects."""
import torch.nn.functional as _F

from .. import _forward

__getattr__, __dir__ = _forward.forward(globals(), _F)
