"""`Sequential`: layers applied in order, their backwards in reverse order."""

from __future__ import annotations

from collections.abc import Iterator

from axond.nn.device import Array
from axond.nn.module import Module


class Sequential(Module):
    """Chain of modules named "0", "1", ... (so state_dict keys read "0.weight")."""

    def __init__(self, *layers: Module) -> None:
        super().__init__()
        for i, layer in enumerate(layers):
            if not isinstance(layer, Module):
                raise TypeError(f"Sequential takes Modules, argument {i} is a {type(layer).__name__}")
            setattr(self, str(i), layer)

    def forward(self, x: Array) -> Array:
        for layer in self._modules.values():
            x = layer(x)
        return x

    def backward(self, grad_out: Array) -> Array:
        g = grad_out
        for layer in reversed(list(self._modules.values())):
            g = layer.backward(g)
        return g

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())

    def __getitem__(self, index: int) -> Module:
        layers = list(self._modules.values())
        return layers[index]

    def append(self, layer: Module) -> Sequential:
        setattr(self, str(len(self._modules)), layer)
        return self
