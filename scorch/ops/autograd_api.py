"""``torch.autograd.grad`` and ``torch.autograd.backward`` (``Tensor.backward``) with SparseTensor outputs,
gradients or inputs. A SparseTensor's graph lives on its stored values (``values()``), not on the wrapper: each
SparseTensor among the outputs stands for its values (a dense gradient for it is read at its stored positions,
0 at padding), among the inputs for its values too, and a gradient computed for one comes back on its pattern
(a SparseTensor sharing its index arrays), as ``S.grad`` does. ``torch.autograd.grad(loss, S)`` and
``loss.backward(inputs=[S])`` found no graph through the wrapper ("appears to not have been used in the graph",
or no gradient at all)."""
from __future__ import annotations

import torch

from .._autograd import values_at
from .._traceable import torch_requires_grad
from ..sparse_tensor import SparseTensor, implements


def _tuple(x) -> tuple:
    return (x,) if isinstance(x, torch.Tensor) or not isinstance(x, (tuple, list)) else tuple(x)


def _graph_outputs(outputs, grad_outputs):
    """``(tensors, gradients)`` for torch's autograd: each SparseTensor output as its values, its gradient aligned
    with them (a sparse one of the same pattern as its values, any other read at the output's stored positions;
    none for a one-element output: ones, as torch's implicit gradient of a scalar)."""
    tensors, grads = [], []
    for out, g in zip(outputs, grad_outputs):
        if type(out) is SparseTensor:
            if g is None:
                if out.numel() != 1:
                    raise RuntimeError("grad can be implicitly created only for scalar outputs")
                g = torch.ones_like(out._vals)
            else:  # (a gradient on the output's own arrays gives its values; padding takes none)
                g = values_at(g, out)
            out = out._vals
        elif type(g) is SparseTensor:
            g = g.to_dense()
        tensors.append(out)
        grads.append(g)
    return tensors, grads


@implements(torch.autograd.grad)
def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False, only_inputs=True,
         allow_unused=None, is_grads_batched=False, materialize_grads=False):
    """``torch.autograd.grad``; a SparseTensor input's gradient on its pattern (see the module text)."""
    outputs, inputs = _tuple(outputs), _tuple(inputs)
    given = [None] * len(outputs) if grad_outputs is None else list(_tuple(grad_outputs))
    if len(given) != len(outputs):
        raise RuntimeError(f"grad requires one gradient per output: got {len(given)} for {len(outputs)} outputs")
    tensors, grads = _graph_outputs(outputs, given)
    # a sparse leaf is a leaf of torch's graph itself, where torch reads the wrapper (a compiled graph, a user's
    # autograd.Function: ``_traceable``): both it and its values are differentiated, and their gradients added
    bridged = [_leaf_wrapper(x) for x in inputs]
    flat = [x._vals if type(x) is SparseTensor else x for x in inputs] + [x for x, b in zip(inputs, bridged) if b]
    with torch._C.DisableTorchFunctionSubclass():
        got = list(torch.autograd.grad(tensors, flat, grads, retain_graph=retain_graph, create_graph=create_graph,
                                       only_inputs=only_inputs, allow_unused=allow_unused or any(bridged),
                                       is_grads_batched=is_grads_batched, materialize_grads=materialize_grads))
    extra = iter(got[len(inputs):])
    for k, b in enumerate(bridged):
        if b:
            g = next(extra)
            g = None if g is None else values_at(g, inputs[k])
            got[k] = g if got[k] is None else got[k] if g is None else got[k] + g
            if got[k] is None and not allow_unused:
                raise RuntimeError("One of the differentiated Tensors appears to not have been used in the graph. "
                                   "Set allow_unused=True if this is the desired behavior.")
    return tuple(g if g is None or type(x) is not SparseTensor else _on_pattern(x, g)
                 for x, g in zip(inputs, got[:len(inputs)]))


def _leaf_wrapper(x) -> bool:
    """Whether ``x`` is a SparseTensor whose wrapper is a leaf of torch's graph requiring grad
    (``_autograd.attach_wrapper``)."""
    return type(x) is SparseTensor and x.__dict__.get("_bridged", False) and torch_requires_grad(x)


def _on_pattern(x: SparseTensor, g: torch.Tensor) -> SparseTensor:
    out = x.detach().with_values(g)
    out._pattern_grad = True  # (as ``S.grad``: a gradient on the pattern, for the optimizers)
    return out


@implements(torch.autograd.backward)
def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None, inputs=None):
    """``torch.autograd.backward`` (``Tensor.backward``); a SparseTensor among ``inputs`` stands for its values
    (its ``.grad`` is read on its pattern)."""
    tensors = _tuple(tensors)
    given = grad_tensors if grad_tensors is not None else grad_variables
    given = [None] * len(tensors) if given is None else list(_tuple(given))
    graph, grads = _graph_outputs(tensors, given)
    if inputs is not None:  # (a sparse leaf's wrapper too: see ``grad``)
        given_inputs = _tuple(inputs)
        inputs = [x._vals if type(x) is SparseTensor else x for x in given_inputs] + [
            x for x in given_inputs if _leaf_wrapper(x)]
    with torch._C.DisableTorchFunctionSubclass():
        torch.autograd.backward(graph, grads, retain_graph=retain_graph, create_graph=create_graph, inputs=inputs)


@implements(torch.Tensor.register_hook)
def register_hook(x, hook):
    """A hook on the gradient of ``x``'s values, called with it on ``x``'s pattern (a SparseTensor); what it
    returns (a SparseTensor on that pattern, a values tensor, or None) replaces the gradient as torch's hooks do.
    Returns the handle (``handle.remove()``)."""
    if type(x) is not SparseTensor:
        return torch.Tensor.register_hook(x, hook)

    def on_values(g):
        r = hook(_on_pattern(x, g))
        if r is None:
            return None
        if type(r) is SparseTensor:
            if r._vals.shape != g.shape:
                raise RuntimeError("scorch: a gradient hook on a SparseTensor must return a gradient on its pattern")
            return r._vals
        return r
    return x._vals.register_hook(on_values)


@implements(torch.Tensor.register_post_accumulate_grad_hook)
def register_post_accumulate_grad_hook(x, hook):
    """``hook(x)`` after the gradient of ``x`` (a leaf) is accumulated into ``x.grad``, as torch calls it."""
    if type(x) is not SparseTensor:
        return torch.Tensor.register_post_accumulate_grad_hook(x, hook)
    return x._vals.register_post_accumulate_grad_hook(lambda _: hook(x))
