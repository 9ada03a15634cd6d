"""Which modules become FSDP units, which parameters each unit owns, and swapping them for managed ones.

A parameter belongs to the innermost unit whose module tree contains it. Frozen parameters
(`requires_grad=False`) are left alone: replicated, not sharded. The user's original `Parameter`
objects are retired (their class becomes `FlattenedParameter`), so an optimizer built before wrapping
fails loudly on its first `zero_grad()`/`step()` instead of silently training nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Union

from axond.nn.device import Array, device_of
from axond.nn.module import Module, Parameter

WrapPolicy = Union[Callable[[Module], bool], Sequence[Module], None]
"""None: the whole module is one unit; a list of submodules; or a predicate choosing submodules."""

_RETIRED = (
    "this Parameter was flattened into FullyShardedDataParallel's shards when the module was wrapped: "
    "build the optimizer after wrapping, from fsdp.parameters(), and read values with fsdp.full_state_dict() "
    "or inside fsdp.summon_full_params()"
)


class FlattenedParameter(Parameter):
    """A user Parameter whose values now live in FSDP's shards: any use of `.data`/`.grad` explains that."""

    @property  # type: ignore[override]
    def data(self) -> Array:
        raise RuntimeError(_RETIRED)

    @data.setter
    def data(self, value: Array) -> None:
        raise RuntimeError(_RETIRED)

    @property  # type: ignore[override]
    def grad(self) -> Array | None:
        raise RuntimeError(_RETIRED)

    @grad.setter
    def grad(self, value: Array | None) -> None:
        raise RuntimeError(_RETIRED)

    def __repr__(self) -> str:
        return "FlattenedParameter(moved into FSDP shards)"


@dataclass
class UnitPlan:
    """The trainable parameters one unit owns, with every (module, attribute) and state-dict name using each."""

    module: Module
    params: list[Parameter] = field(default_factory=list)
    sites: list[list[tuple[Module, str]]] = field(default_factory=list)
    names: list[list[str]] = field(default_factory=list)


def select_unit_modules(root: Module, wrap: WrapPolicy) -> list[Module]:
    """The root plus the submodules `wrap` names, each once, in the root's module order."""
    descendants = [m for m in root.modules() if m is not root]
    if wrap is None:
        return [root]
    if isinstance(wrap, Module):
        raise TypeError("wrap= takes a list of submodules or a predicate, not a single Module; pass [module]")
    if callable(wrap):
        chosen = {id(m) for m in descendants if wrap(m)}
    else:
        items = list(wrap)
        known = {id(m) for m in descendants}
        for i, m in enumerate(items):
            if not isinstance(m, Module):
                raise TypeError(f"wrap[{i}] must be an axond.nn.Module, got {type(m).__name__}")
            if id(m) not in known and m is not root:
                raise ValueError(f"wrap[{i}] ({type(m).__name__}) is not a submodule of the wrapped module")
        chosen = {id(m) for m in items}
    return [root] + [m for m in descendants if id(m) in chosen]


def plan_units(root: Module, unit_modules: Sequence[Module]) -> list[UnitPlan]:
    """Assign each trainable parameter to the innermost unit containing it; check one dtype/device per unit."""
    unit_of = {id(m): i for i, m in enumerate(unit_modules)}
    plans = [UnitPlan(m) for m in unit_modules]
    owner: dict[int, tuple[int, int]] = {}
    seen: set[int] = set()

    def walk(module: Module, prefix: str, unit: int) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        unit = unit_of.get(id(module), unit)
        plan = plans[unit]
        for name, p in module._parameters.items():
            if not p.requires_grad:
                continue
            where = owner.get(id(p))
            if where is None:
                owner[id(p)] = (unit, len(plan.params))
                plan.params.append(p)
                plan.sites.append([(module, name)])
                plan.names.append([prefix + name])
            elif where[0] != unit:
                first = plans[where[0]].names[where[1]][0]
                raise NotImplementedError(
                    f"parameter {prefix + name!r} is the same Parameter as {first!r} but they fall in different "
                    "FSDP units; wrap the modules sharing it into one unit"
                )
            else:
                plan.sites[where[1]].append((module, name))
                plan.names[where[1]].append(prefix + name)
        for child_name, child in module._modules.items():
            walk(child, f"{prefix}{child_name}.", unit)

    walk(root, "", 0)
    for i, plan in enumerate(plans):
        kinds = {(str(p.dtype), str(device_of(p.data))) for p in plan.params}
        if len(kinds) > 1:
            raise ValueError(
                f"FSDP unit {i} ({type(plan.module).__name__}) mixes parameter dtypes/devices {sorted(kinds)}; "
                "wrap= the modules of each dtype as units of their own"
            )
    return [p for p in plans if p.params]


def install(plan: UnitPlan, managed: Sequence[Parameter]) -> None:
    """Give the modules `managed` in place of the originals (unregistered), and retire the originals."""
    for original, sites, new in zip(plan.params, plan.sites, managed):
        for module, name in sites:
            del module._parameters[name]
            module.__dict__[name] = new
        original.__dict__.pop("data", None)
        original.__dict__.pop("grad", None)
        original.__class__ = FlattenedParameter
