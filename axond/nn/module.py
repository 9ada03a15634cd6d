"""`Module` and `Parameter`: layers with an explicit forward and backward, and the hooks wrappers use.

A layer's `forward(x)` caches what its `backward(grad_out)` needs in `self._ctx`; `backward`
accumulates into each parameter's `.grad` and returns the gradient with respect to the input.
Calling `module(x)` runs the forward hooks around `forward`; `backward` runs the backward hooks
around itself, then each direct parameter's post-accumulate-grad hooks: that is the moment DDP
launches a bucket's all-reduce, while the layers below are still running their backward.
"""

from __future__ import annotations

import functools
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from axond.nn.device import Array, Device, array_module, device_of, parse_device, to_device

_handle_ids = itertools.count()


class RemovableHandle:
    """Returned by every `register_*_hook`; `remove()` unregisters the hook."""

    def __init__(self, registry: dict[int, Any]) -> None:
        self._registry = registry
        self.id = next(_handle_ids)

    def remove(self) -> None:
        """Unregister the hook (idempotent)."""
        self._registry.pop(self.id, None)


class Parameter:
    """A trainable array: `.data` (updated by the optimizer) and `.grad` (accumulated by backward)."""

    def __init__(self, data: Array, requires_grad: bool = True) -> None:
        self.data = data
        self.grad: Array | None = None
        self.requires_grad = requires_grad
        self._grad_hooks: dict[int, Callable[[Parameter], None]] = {}
        self._step_hooks: dict[int, Callable[[Parameter], None]] = {}

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.data.dtype  # type: ignore[no-any-return]

    @property
    def size(self) -> int:
        return int(self.data.size)

    def accumulate_grad(self, g: Array) -> None:
        """Add `g` into `.grad` (taking ownership of `g` when `.grad` is empty)."""
        if not self.requires_grad:
            return
        if self.grad is None:
            self.grad = g
        else:
            self.grad += g

    def register_post_accumulate_grad_hook(self, hook: Callable[[Parameter], None]) -> RemovableHandle:
        """Call `hook(param)` each time a backward has finished accumulating into `.grad`."""
        handle = RemovableHandle(self._grad_hooks)
        self._grad_hooks[handle.id] = hook
        return handle

    def _grad_ready(self) -> None:
        for hook in list(self._grad_hooks.values()):
            hook(self)

    def register_pre_step_hook(self, hook: Callable[[Parameter], None]) -> RemovableHandle:
        """Call `hook(param)` before an `axond.nn.optim` optimizer updates this parameter from `.grad`; the hook
        may raise to stop the step (DDP does when a backward bypassed it and `.grad` is not averaged)."""
        handle = RemovableHandle(self._step_hooks)
        self._step_hooks[handle.id] = hook
        return handle

    def _before_step(self) -> None:
        for hook in list(self._step_hooks.values()):
            hook(self)

    def __repr__(self) -> str:
        return f"Parameter(shape={self.shape}, dtype={self.dtype}, device={device_of(self.data)})"


def _hooked_backward(fn: Callable[[Module, Array], Array]) -> Callable[[Module, Array], Array]:
    """Wrap a subclass's `backward` so hooks fire once per call, even through `super().backward`."""

    @functools.wraps(fn)
    def backward(self: Module, grad_out: Array) -> Array:
        if self.__dict__.get("_in_backward", False):
            return fn(self, grad_out)
        object.__setattr__(self, "_in_backward", True)
        try:
            for pre in list(self._backward_pre_hooks.values()):
                replaced = pre(self, grad_out)
                if replaced is not None:
                    grad_out = replaced
            grad_in = fn(self, grad_out)
            for post in list(self._backward_hooks.values()):
                replaced = post(self, grad_out, grad_in)
                if replaced is not None:
                    grad_in = replaced
        finally:
            object.__setattr__(self, "_in_backward", False)
        for p in self._parameters.values():
            if p.requires_grad and p.grad is not None:
                p._grad_ready()
        return grad_in

    backward._axond_hooked = True  # type: ignore[attr-defined]
    return backward


class Module:
    """Base class of layers and models: parameters, buffers and child modules registered by attribute."""

    _parameters: dict[str, Parameter]
    _buffers: dict[str, Array]
    _modules: dict[str, Module]
    _ctx: Any
    """What the last forward cached for backward (None when there is nothing to differentiate)."""
    training: bool

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        fn = cls.__dict__.get("backward")
        if fn is not None and not getattr(fn, "_axond_hooked", False):
            cls.backward = _hooked_backward(fn)  # type: ignore[method-assign, assignment]

    def __init__(self) -> None:
        d = self.__dict__
        d["_parameters"] = OrderedDict()
        d["_buffers"] = OrderedDict()
        d["_non_persistent"] = set()
        d["_modules"] = OrderedDict()
        d["_forward_pre_hooks"] = {}
        d["_forward_hooks"] = {}
        d["_backward_pre_hooks"] = {}
        d["_backward_hooks"] = {}
        d["training"] = True
        d["_ctx"] = None

    def __setattr__(self, name: str, value: Any) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}.__init__ must call super().__init__() before setting {name!r}")
        if isinstance(value, Parameter):
            self.__dict__.pop(name, None)
            self._modules.pop(name, None)
            self._parameters[name] = value
        elif isinstance(value, Module):
            self.__dict__.pop(name, None)
            self._parameters.pop(name, None)
            self._modules[name] = value
        elif name in self._buffers:
            self._buffers[name] = value
        else:
            self._parameters.pop(name, None)
            self._modules.pop(name, None)
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        for key in ("_parameters", "_modules", "_buffers"):
            registry = d.get(key)
            if registry is not None and name in registry:
                return registry[name]
        raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        for registry in (self._parameters, self._modules, self._buffers):
            if name in registry:
                del registry[name]
                return
        object.__delattr__(self, name)

    def register_buffer(self, name: str, value: Array, persistent: bool = True) -> None:
        """Register a non-trainable array (saved in `state_dict` unless `persistent=False`)."""
        if name in self._parameters or name in self._modules:
            raise ValueError(f"cannot register buffer {name!r}: a parameter or module has that name")
        self._buffers[name] = value
        if persistent:
            self._non_persistent.discard(name)
        else:
            self._non_persistent.add(name)

    def forward(self, x: Array) -> Array:
        """Compute the output and cache in `self._ctx` what `backward` needs."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward(x)")

    def backward(self, grad_out: Array) -> Array:
        """Accumulate parameter gradients and return d loss / d input."""
        raise NotImplementedError(f"{type(self).__name__} must implement backward(grad_out)")

    def __call__(self, x: Array) -> Array:
        for pre in list(self._forward_pre_hooks.values()):
            replaced = pre(self, x)
            if replaced is not None:
                x = replaced
        out = self.forward(x)
        for post in list(self._forward_hooks.values()):
            replaced = post(self, x, out)
            if replaced is not None:
                out = replaced
        return out

    def register_forward_pre_hook(self, hook: Callable[[Module, Array], Array | None]) -> RemovableHandle:
        """`hook(module, x)` before forward; a non-None return replaces `x`."""
        return self._add_hook(self._forward_pre_hooks, hook)

    def register_forward_hook(self, hook: Callable[[Module, Array, Array], Array | None]) -> RemovableHandle:
        """`hook(module, x, out)` after forward; a non-None return replaces `out`."""
        return self._add_hook(self._forward_hooks, hook)

    def register_backward_pre_hook(self, hook: Callable[[Module, Array], Array | None]) -> RemovableHandle:
        """`hook(module, grad_out)` before backward; a non-None return replaces `grad_out`."""
        return self._add_hook(self._backward_pre_hooks, hook)

    def register_backward_hook(self, hook: Callable[[Module, Array, Array], Array | None]) -> RemovableHandle:
        """`hook(module, grad_out, grad_in)` after backward; a non-None return replaces `grad_in`."""
        return self._add_hook(self._backward_hooks, hook)

    @staticmethod
    def _add_hook(registry: dict[int, Any], hook: Any) -> RemovableHandle:
        handle = RemovableHandle(registry)
        registry[handle.id] = hook
        return handle

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        """This module and every descendant, each once, depth first in registration order."""
        seen: set[int] = set()

        def walk(module: Module, name: str) -> Iterator[tuple[str, Module]]:
            if id(module) in seen:
                return
            seen.add(id(module))
            yield name, module
            for child_name, child in module._modules.items():
                yield from walk(child, f"{name}.{child_name}" if name else child_name)

        yield from walk(self, prefix)

    def modules(self) -> Iterator[Module]:
        for _, m in self.named_modules():
            yield m

    def children(self) -> Iterator[Module]:
        yield from self._modules.values()

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, Parameter]]:
        """(dotted name, parameter) pairs, each parameter once, in registration order."""
        seen: set[int] = set()
        modules = self.named_modules(prefix) if recurse else iter([(prefix, self)])
        for mod_name, module in modules:
            for name, p in module._parameters.items():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{mod_name}.{name}" if mod_name else name), p

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, Array]]:
        for mod_name, module in self.named_modules(prefix):
            for name, b in module._buffers.items():
                yield (f"{mod_name}.{name}" if mod_name else name), b

    def buffers(self) -> Iterator[Array]:
        for _, b in self.named_buffers():
            yield b

    def state_dict(self) -> OrderedDict[str, Array]:
        """Name -> array for every parameter and persistent buffer (the live arrays, not copies)."""
        state: OrderedDict[str, Array] = OrderedDict()
        for mod_name, module in self.named_modules():
            for name, p in module._parameters.items():
                state[f"{mod_name}.{name}" if mod_name else name] = p.data
            for name, b in module._buffers.items():
                if name not in module._non_persistent:
                    state[f"{mod_name}.{name}" if mod_name else name] = b
        return state

    def load_state_dict(self, state: Mapping[str, Array], strict: bool = True) -> tuple[list[str], list[str]]:
        """Copy `state` into the parameters and buffers in place. Returns (missing, unexpected) keys."""
        own = self.state_dict()
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected} (pass strict=False to ignore)")
        for key, target in own.items():
            if key not in state:
                continue
            value = state[key]
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"load_state_dict: {key!r} has shape {tuple(value.shape)}, the module expects {tuple(target.shape)}")
            xp = array_module(target)
            target[...] = xp.asarray(to_device(value, device_of(target)), dtype=target.dtype)
        return missing, unexpected

    def train(self, mode: bool = True) -> Module:
        """Set training mode (Dropout active) on this module and its descendants."""
        for m in self.modules():
            m.__dict__["training"] = mode
        return self

    def eval(self) -> Module:
        """Set evaluation mode (Dropout is the identity)."""
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every parameter's gradient (to None, or to zeros in place)."""
        for p in self.parameters():
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.fill(0)

    def to(self, device: str | Device | None = None, dtype: Any = None) -> Module:
        """Move parameters, gradients and buffers to `device` ("cpu", "cuda[:i]") and/or cast to `dtype`."""
        target = parse_device(device) if device is not None else None

        def move(a: Array) -> Array:
            if target is not None:
                a = to_device(a, target)
            if dtype is not None and a.dtype != np.dtype(dtype) and a.dtype.kind == "f":
                a = a.astype(dtype)
            return a

        for p in self.parameters():
            p.data = move(p.data)
            if p.grad is not None:
                p.grad = move(p.grad)
        for module in self.modules():
            for name in list(module._buffers):
                module._buffers[name] = move(module._buffers[name])
            module.__dict__["_ctx"] = None
        return self

    def save_context(self) -> list[Any]:
        """Take the forward caches of this module tree (so several forwards can precede their backwards)."""
        out = []
        for m in self.modules():
            out.append(m.__dict__["_ctx"])
            m.__dict__["_ctx"] = None
        return out

    def restore_context(self, ctx: list[Any]) -> None:
        """Put back caches taken by `save_context` before running the matching backward."""
        mods = list(self.modules())
        if len(ctx) != len(mods):
            raise ValueError(f"restore_context: got {len(ctx)} caches for {len(mods)} modules")
        for m, c in zip(mods, ctx):
            m.__dict__["_ctx"] = c

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for name, child in self._modules.items():
            child_repr = repr(child).replace("\n", "\n  ")
            lines.append(f"  ({name}): {child_repr}")
        return lines[0] + ")" if len(lines) == 1 else "\n".join(lines) + "\n)"


def require_ctx(module: Module) -> Any:
    """The forward cache of `module`, or a clear error if backward runs without a forward."""
    ctx = module.__dict__["_ctx"]
    if ctx is None:
        raise RuntimeError(f"{type(module).__name__}.backward called without a preceding forward (or after to())")
    return ctx
