"""What ``torch.optim`` takes as ``params``, read into named entries for the router.

Tensors, ``(name, tensor)`` pairs or param-group dicts, refused as ``torch.optim`` refuses
them; an unnamed tensor is named by its place (``param_groups[1].params[0]``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch


@dataclasses.dataclass
class Entry:
    """One parameter given without its model: its name, tensor and param group."""

    name: str
    param: torch.Tensor
    group: int | None = None
    bare: bool = False  # no name given: ``params[i]``


def _is_pair(x: Any) -> bool:
    return (isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)
            and isinstance(x[1], torch.Tensor))


def group_members(group: Mapping[str, Any], index: int | None, prefix: str) -> list[Entry]:
    """The members of one param group (tensors or ``(name, tensor)`` pairs) as entries."""
    params = group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, "
                        "but the ordering of tensors in sets will change between runs; use a "
                        "list")
    params = list(params)
    names = group.get("param_names")
    if names is not None and len(list(names)) != len(params):
        raise ValueError(f"param group {index}: {len(list(names))} param_names for "
                         f"{len(params)} params")
    out = []
    for i, x in enumerate(params):
        if _is_pair(x):
            out.append(Entry(x[0], x[1], index))
        elif isinstance(x, torch.Tensor):
            if names is not None:
                out.append(Entry(str(list(names)[i]), x, index))
            else:
                out.append(Entry(f"{prefix}params[{i}]", x, index, bare=True))
        else:
            raise TypeError(f"optimizer can only optimize Tensors, but {prefix}params[{i}] "
                            f"is a {type(x).__name__}")
    if any(_is_pair(x) for x in params) and not all(_is_pair(x) for x in params):
        raise ValueError("all optimizer params should be with/without names. Some param names "
                         f"are missing (param group {index})" if index is not None else
                         "all optimizer params should be with/without names. Some param "
                         "names are missing")
    return out


def entries(params: Any) -> tuple[list[Entry], list[dict[str, Any]]]:
    """What ``torch.optim`` accepts as ``params``, as entries and the groups' options."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params argument given to the optimizer should be an iterable of "
                        "Tensors or dicts (or the nn.Module), but got a "
                        f"{torch.typename(params)}")
    if isinstance(params, Mapping):
        raise TypeError("params must be an nn.Module, an iterable of tensors, of (name, "
                        "tensor) pairs or of param-group dicts; got a mapping (for a state "
                        "dict, pass list(state_dict.items()) or the model)")
    items = list(params)
    if not items:
        raise ValueError("optimizer got an empty parameter list")
    if not all(isinstance(x, dict) for x in items):
        if any(isinstance(x, dict) for x in items):
            raise TypeError("params mixes param-group dicts with tensors; give groups only")
        return group_members({"params": items}, None, ""), []
    entries, options = [], []
    for gi, group in enumerate(items):
        if "params" not in group:
            raise ValueError(f"param group {gi} has no 'params'")
        if "rule" in group:
            raise ValueError(
                f"param group {gi} sets rule={group['rule']!r}: make_optimizer gives each "
                "kind its configuration's rule; give kind= (and fan_in_dim=/fan_out_dim=) "
                "instead, or add the group afterwards with opt.add_param_group")
        entries += group_members(group, gi, f"param_groups[{gi}].")
        options.append({k: v for k, v in group.items() if k not in ("params", "param_names")})
    return entries, options
