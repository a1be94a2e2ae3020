"""``scorch.nn.functional``: torch.nn.functional's functions. A sparse operand reaches scorch through
``SparseTensor.__torch_function__``; the functions are torch's own, run again with torch's sparse layouts viewed
as SparseTensors where torch refuses them (``scorch._forward.on_torch_layouts``)."""
import torch.nn.functional as _F

from .. import _forward

__getattr__, __dir__ = _forward.forward(globals(), _F, routed=True)
