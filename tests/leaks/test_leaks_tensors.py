"""Autograd-node introspection (``_runtime.torch_private``) and graph walking (``leaks.tensors``) on real graphs."""

from __future__ import annotations

import torch
from torch import nn

from memcallbacks._base.torch_private import is_autograd_node, node_metadata, saved_tensors_of
from memcallbacks.leaks.tensors import describe_tensor, graph_tensors, is_parameter, node_children


class _ScaleWithCtxAttribute(torch.autograd.Function):
    """Saves its input the official way and a second tensor as a plain ``ctx`` attribute."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        return grad * ctx.scale, (grad * x).sum().reshape(ctx.scale.shape)


def test_saved_tensors_of_a_cpp_node_until_backward_frees_them():
    x = torch.randn(4, 8, requires_grad=True)
    y = torch.tanh(x)  # TanhBackward0 saves its result
    saved = saved_tensors_of(y.grad_fn)
    assert len(saved) == 1 and torch.equal(saved[0], y)
    y.sum().backward()
    assert saved_tensors_of(y.grad_fn) == []  # freed by backward: no error, nothing listed


def test_saved_tensors_of_a_python_function_lists_saved_and_ctx_tensors():
    x = torch.randn(3, 5, requires_grad=True)
    scale = torch.full((1,), 2.0, requires_grad=True)
    out = _ScaleWithCtxAttribute.apply(x, scale)
    saved = saved_tensors_of(out.grad_fn)
    assert any(t is x or torch.equal(t, x) for t in saved)
    assert any(t is scale for t in saved)
    assert len(saved) == 2


def test_is_autograd_node_and_metadata_live_with_the_node():
    w = nn.Parameter(torch.randn(8, 8))
    out = (torch.randn(2, 8) @ w).relu()
    fn = out.grad_fn
    assert is_autograd_node(fn) and not is_autograd_node(out) and not is_autograd_node({})
    node_metadata(fn)["mark"] = 7
    assert node_metadata(out.grad_fn)["mark"] == 7  # the same dict each time it is asked for
    leaves = [c for node in [fn] for c, how in node_children(node) if how == "node"]
    assert leaves and all(is_autograd_node(c) for c in leaves)


def test_graph_walk_reaches_leaves_and_saved_tensors():
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    x = torch.randn(4, 16, requires_grad=True)
    loss = model(x).sum()
    found = list(graph_tensors([loss]))
    leaves = [t for t, how in found if how == "leaf"]
    assert any(t is x for t in leaves)
    assert {id(p) for p in model.parameters()} <= {id(t) for t in leaves}
    assert sum(is_parameter(t) for t in leaves) == 4 and not is_parameter(x)
    assert any(how == "saved" and describe_tensor(t) == "4x32 float32" for t, how in found)
