"""The checks behind the backend options' fields: each takes the field's name and a value,
and returns what the field stores or raises an error that names the field, the bad value and
the fix."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Union

import torch

from .._rendezvous import secret as _secret
from ..errors import OptionTypeError

DeviceLike = Union[int, str, torch.device]


class Field:
    """A validated attribute of an options object: ``check(name, value, *args)`` gives
    what is stored (in ``_<name>``) or raises."""

    def __init__(self, check: Callable[..., Any], doc: str, *args: Any) -> None:
        self.check = check
        self.args = args
        self.__doc__ = doc
        self.name = self.slot = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, f"_{name}"

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        return self if obj is None else getattr(obj, self.slot)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj, self.slot, self.check(self.name, value, *self.args))


def to_device(d: DeviceLike) -> torch.device:
    """``d`` as a device: an int is a CUDA index. A negative index or a string torch does
    not read raises torch's RuntimeError, its wording first."""
    if isinstance(d, torch.device):
        return d
    if isinstance(d, bool) or not isinstance(d, (int, str)):
        raise TypeError(f"a device must be an int, str or torch.device, got {type(d).__name__}")
    try:
        return torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc} (got {d!r}): name a device as 'cpu', 'cuda:N' or the "
                           f"CUDA index N >= 0") from None


def normalize_device_map(to: str, device_map: Dict[DeviceLike, DeviceLike]
                         ) -> Dict[torch.device, torch.device]:
    """One call's device map for worker ``to``, as devices; like torch, no two sources may
    map to one target within it (``init_rpc`` checks the map that calls add up to)."""
    if not isinstance(to, str):
        raise TypeError(f"device map key must be a worker name (str), got {type(to).__name__}")
    if not isinstance(device_map, dict):
        raise TypeError(f"device map for {to!r} must be a dict, got {type(device_map).__name__}")
    out: Dict[torch.device, torch.device] = {}
    sources: Dict[torch.device, torch.device] = {}
    for src, dst in device_map.items():
        s, d = to_device(src), to_device(dst)
        if d in sources:
            raise ValueError(
                f"`device_map` only supports 1-to-1 mapping, trying to map {s} and "
                f"{sources[d]} to {d} (device map for {to!r}): every target device may "
                f"appear once, so that replies can travel back through the inverse map")
        sources[d] = s
        out[s] = d
    return out


def merge_device_map(to: str, current: Dict[torch.device, torch.device],
                     new: Dict[torch.device, torch.device]) -> Dict[torch.device, torch.device]:
    """``current`` with the entries of ``new`` added; a source already mapped elsewhere
    raises torch's ValueError."""
    for s, d in new.items():
        if s in current and current[s] != d:
            raise ValueError(
                f"`set_device_map` only supports 1-to-1 mapping, trying to map {s} to {d} "
                f"and {current[s]} (device map for {to!r}): a source device maps to one "
                f"target; build new options to change it")
    return {**current, **new}


def cuda_devices(devices: Any) -> List[torch.device]:
    """The agent's local ``devices``: CUDA devices only, as torch requires."""
    if not isinstance(devices, (list, tuple)):
        raise TypeError(f"devices must be a list, got {type(devices).__name__}")
    out = [to_device(d) for d in devices]
    for d in out:
        if d.type != "cuda":
            raise ValueError(f"`set_devices` expect a list of CUDA devices, but got device "
                             f"type {d.type}. Name CUDA devices only: CPU tensors need no "
                             f"entry")
    return out


def seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def check_heartbeat(interval: float, timeout: float) -> None:
    if interval > 0 and 0 < timeout <= interval:
        raise ValueError(f"heartbeat_timeout ({timeout:g} s) must be longer than "
                         f"heartbeat_interval ({interval:g} s), or 0 to never time out; "
                         f"a few intervals is usual")


def count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def path_or_none(name: str, value: Any) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise TypeError(f"{name} must be a file path (str) or None, got {value!r}")
    return os.fspath(value)


def name_or_none(name: str, value: Any, fix: str) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty str or None, got {value!r}; {fix}")
    return value


def spin_us(name: str, value: Any) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1e6:
        raise ValueError(f"spin_us must be microseconds between 0 and 1e6 (0: never poll) or "
                         f"None, got {value!r}")
    return float(value)


def rendezvous_seconds(name: str, value: Any) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"rendezvous_timeout must be a number of seconds > 0 or None (the "
                         f"RPC timeout, at least 60 s), got {value!r}")
    return float(value)


def secret_or_none(name: str, value: Any) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        # The value is never shown: it may be a real secret of the wrong type.
        raise ValueError(f"secret must be a non-empty str or None, got a "
                         f"{type(value).__name__}; give every worker the same random string "
                         f"of at least {_secret.MIN_LENGTH} characters")
    return value


def flag_or_none(name: str, value: Any) -> Optional[bool]:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool or None, got {value!r}")
    return value


def check_number(cls: str, name: str, value: Any, construction: bool = False,
                  integer: bool = False) -> None:
    """Raise torch's TypeError (pybind's wording) when ``value`` is not a number."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        where = (f"{cls}.__init__(): incompatible constructor arguments" if construction
                 else f"{cls}.{name}: incompatible function arguments")
        fix = (" (a datetime.timedelta: pass its .total_seconds())"
               if hasattr(value, "total_seconds") else "")
        raise OptionTypeError(
            f"{where}. {name} must be "
            f"{'an int' if integer else 'a number of seconds (float)'}, got "
            f"{type(value).__name__} {value!r}{fix}")


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value
