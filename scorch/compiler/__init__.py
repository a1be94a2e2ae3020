"""The tensor-algebra compiler (DESIGN.md section 3): index notation -> format inference -> schedule ->
lowering over the level interface (``scorch.formats.levels``) -> C++/CUDA -> cached kernels.

The pipeline lands with the compiler issue. ``torch.compiler`` shares this name, so its names are forwarded
here: ``import scorch as torch; torch.compiler.disable`` stays torch's own.
"""
import torch.compiler as _torch_compiler

from .. import _forward

__getattr__, __dir__ = _forward.forward(globals(), _torch_compiler)
