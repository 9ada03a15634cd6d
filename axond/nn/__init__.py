"""Modules with an explicit backward, losses and optimizers on NumPy (CPU) or CuPy (GPU) arrays."""

from axond.nn import init, optim, utils
from axond.nn.activations import GELU, Dropout, ReLU, Tanh
from axond.nn.container import Sequential
from axond.nn.device import Device, array_module, parse_device, to_device
from axond.nn.grad_scaler import GradScaler
from axond.nn.linear import Embedding, Linear
from axond.nn.loss import CrossEntropyLoss, MSELoss
from axond.nn.module import Module, Parameter, RemovableHandle
from axond.nn.norm import LayerNorm
from axond.nn.transformer import MLP, CausalSelfAttention, TransformerBlock

__all__ = [
    "GELU",
    "GradScaler",
    "MLP",
    "CausalSelfAttention",
    "CrossEntropyLoss",
    "Device",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "Linear",
    "MSELoss",
    "Module",
    "Parameter",
    "ReLU",
    "RemovableHandle",
    "Sequential",
    "Tanh",
    "TransformerBlock",
    "array_module",
    "init",
    "optim",
    "parse_device",
    "to_device",
    "utils",
]
