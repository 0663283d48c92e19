"""The checks behind the backend options' fields: each takes the field's name and a value,
and returns what the field stores or raises an error that names the field, the bad value and
the fix."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Union

import torch

from .._agent import secret as _secret
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
    if isinstance(d, torch.device):
        return d
    if isinstance(d, int) and not isinstance(d, bool):
        if d < 0:
            raise ValueError(f"device index must be non-negative, got {d}")
        return torch.device("cuda", d)
    if isinstance(d, str):
        try:
            return torch.device(d)
        except RuntimeError as exc:
            raise ValueError(f"invalid device {d!r}: {exc}") from exc
    raise TypeError(f"a device must be an int, str or torch.device, got {type(d).__name__}")


def normalize_device_map(to: str, device_map: Dict[DeviceLike, DeviceLike]
                         ) -> Dict[torch.device, torch.device]:
    """Validate one worker's device map; it must be invertible (no two sources to one target)."""
    if not isinstance(to, str):
        raise TypeError(f"device map key must be a worker name (str), got {type(to).__name__}")
    if not isinstance(device_map, dict):
        raise TypeError(f"device map for {to!r} must be a dict, got {type(device_map).__name__}")
    out: Dict[torch.device, torch.device] = {}
    seen: Dict[torch.device, torch.device] = {}
    for src, dst in device_map.items():
        s, d = to_device(src), to_device(dst)
        if d in seen and seen[d] != s:
            raise ValueError(
                f"device map for {to!r} is not invertible: both {seen[d]} and {s} map to {d}; "
                f"every target device may appear once")
        seen[d] = s
        out[s] = d
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
