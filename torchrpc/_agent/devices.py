"""Device maps: where a tensor lands on a peer, what a worker publishes about its CUDA
devices and maps at rendezvous, and torch's checks of the whole group's maps.

Every worker runs :func:`check` on the same published facts, so a map that does not fit
the group fails ``init_rpc`` on every worker alike, with torch's ValueError and wording.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, List, Optional, Protocol

import torch

from .. import _wire
from ..errors import DeviceMapError
from .worker import WorkerInfo

Map = Dict[torch.device, torch.device]


class Maps(Protocol):
    """Where device placement reads the maps: this worker's to each peer by name, each
    peer's to this worker by rank (the registry, registry.py)."""

    device_maps: Dict[str, Map]
    reply_maps: Dict[int, Map]

    @property
    def worker_info(self) -> WorkerInfo: ...

_CPU = torch.device("cpu")


def _moved_cpu(map_: Optional[Map]) -> Optional[torch.device]:
    """Where ``map_`` sends CPU tensors when that is off the CPU, else None."""
    target = map_.get(_CPU) if map_ else None
    return None if target is None or target.type == "cpu" else target


def watch(*maps: Map) -> None:
    """Turn on the encoder's look-up of where CPU tensors go once one of ``maps`` (maps of
    this worker's devices to a peer's) moves them off the CPU."""
    if any(_moved_cpu(map_) is not None for map_ in maps):
        _wire.device_maps_move_cpu()


def _map_to(registry: Maps, peer: WorkerInfo, reply: bool) -> Optional[Map]:
    """The map tensors to ``peer`` go through: this worker's map for ``peer`` (a request)
    or the inverse of ``peer``'s map for this worker (a reply); None without one."""
    return registry.reply_maps.get(peer.id) if reply else registry.device_maps.get(peer.name)


def cpu_target(registry: Maps, peer: WorkerInfo, reply: bool) -> Optional[torch.device]:
    """Where a CPU tensor lands on ``peer`` (through the map's ``"cpu"`` entry, as in
    :func:`target_device`); None where it stays on the CPU."""
    if peer.id == registry.worker_info.id:
        return None
    return _moved_cpu(_map_to(registry, peer, reply))


def target_device(registry: Maps, peer: WorkerInfo, device: torch.device,
                  reply: bool) -> torch.device:
    """Where a CUDA tensor on ``device`` lands on ``peer``: through this worker's device
    map for ``peer`` (a request), or through the inverse of ``peer``'s map for this worker
    (a reply); on the same device when ``peer`` is this worker. Raises
    :class:`DeviceMapError` (torch's error) where the map has no entry for ``device``."""
    me = registry.worker_info
    if peer.id == me.id:
        return device
    target = (_map_to(registry, peer, reply) or {}).get(device)
    if target is not None:
        return target
    if reply:
        what, fix = "Response", (f"add {device} as a target to the device map that "
                                 f"{peer.name} sets for {me.name}, or return CPU tensors")
    else:
        what, fix = "Request", (f"call options.set_device_map({peer.name!r}, "
                                f"{{{str(device)!r}: ...}}) before init_rpc, or send the "
                                f"tensor's .cpu() copy")
    raise DeviceMapError(
        "TensorPipe RPC backend only supports CPU tensors by default, please move your "
        "tensors to CPU before sending them over RPC, or call `set_device_map` on "
        "`TensorPipeRpcBackendOptions` to explicitly configure device mapping. "
        f"{what} device mapping is not available for destination {peer.name}: a tensor "
        f"on {device} has no entry in the device map; {fix}")


def inverse(map_: Map) -> Map:
    """The inverse of device map ``map_``: where a tensor that crossed by ``map_`` came
    from, by the device it landed on. Raises ValueError where two devices map to one,
    which torch's ``set_device_map`` refuses too ("only supports 1-to-1 mapping")."""
    out: Map = {}
    for src, dst in map_.items():
        if dst in out:
            raise ValueError(f"device map {map_} cannot be inverted: {out[dst]} and {src} "
                             f"both map to {dst}; map each target device from one source "
                             f"only (torch's set_device_map only supports 1-to-1 mapping)")
        out[dst] = src
    return out


def back_map(registry: Maps, peer: WorkerInfo, reply: bool) -> Optional[Map]:
    """The map the gradients of tensors received from ``peer`` go back through: the inverse
    of the map they came by, as torch's RecvRpcBackward keeps it. A request from ``peer``
    came by ``peer``'s map for this worker, whose inverse the registry keeps (``reply_maps``);
    a reply came by the inverse of this worker's map for ``peer``, whose inverse is that
    map. None where no map applies (tensors stayed on the device type they had)."""
    if peer.id == registry.worker_info.id:
        return None
    return registry.device_maps.get(peer.name) if reply else registry.reply_maps.get(peer.id)


def gradient_device(back: Optional[Map], device: torch.device) -> Optional[torch.device]:
    """Where the gradient of a tensor received on ``device`` goes on its sender, through
    ``back`` (see :func:`back_map`): the device the tensor came from. None where it needs
    no placing (a CPU tensor that no map moved). Raises :class:`DeviceMapError` for a
    CUDA device the map does not reach: no tensor can have come from there by it."""
    source = back.get(device) if back else None
    if source is not None:
        return source
    if device.type == "cpu":
        return None
    raise DeviceMapError(
        f"distributed autograd cannot send back the gradient of a tensor received on "
        f"{device}: the device map it came by ({back or 'none'}) has no entry that maps to "
        f"{device}; a tensor received on a CUDA device must have come by the sender's "
        f"device map")


def facts(device_maps: Dict[str, Map], devices: List[torch.device]) -> Dict[str, Any]:
    """The JSON-able facts about this worker's devices that its peers check and use: its
    CUDA device count and the GPUs it sees, its device maps by callee, and the devices it
    was given."""
    out: Dict[str, Any] = {"device_count": torch.cuda.device_count()}
    if out["device_count"]:
        # Which GPUs it sees, so that a peer on its host knows whether a CUDA device index
        # means the same GPU to both (CUDA IPC, cuda_ipc.ipc_possible).
        out["gpus"] = os.environ.get("CUDA_VISIBLE_DEVICES", "*")
    if device_maps:
        out["device_maps"] = {to: {str(a): str(b) for a, b in m.items()}
                              for to, m in device_maps.items()}
    if devices:
        out["devices"] = [str(d) for d in devices]
    return out


def _valid(devices: Iterable[torch.device], count: int) -> bool:
    return all(d.type == "cpu" or (d.type == "cuda" and 0 <= (d.index or 0) < count)
               for d in devices)


def _read(infos: Dict[int, Dict[str, Any]]):
    """Names, device counts, maps and devices by name, as torch's checks take them."""
    names: List[str] = []
    counts: Dict[str, int] = {}
    maps: Dict[str, Dict[str, Map]] = {}
    devices: Dict[str, List[torch.device]] = {}
    for rank in sorted(infos):
        info = infos[rank]
        name = info["name"]
        try:
            counts[name] = int(info.get("device_count") or 0)
            maps[name] = {to: {torch.device(a): torch.device(b) for a, b in m.items()}
                          for to, m in (info.get("device_maps") or {}).items()}
            devices[name] = [torch.device(d) for d in info.get("devices") or ()]
        except (TypeError, ValueError, RuntimeError, AttributeError) as exc:
            raise ValueError(f"worker {name!r} (rank {rank}) published malformed device "
                             f"facts at rendezvous: {exc}") from None
        names.append(name)
    return names, counts, maps, devices


def check(infos: Dict[int, Dict[str, Any]], static: bool = True) -> None:
    """Raise torch's ValueError where a worker's devices or device maps do not fit the
    group ``infos`` describes (by rank, as published). In a dynamic group (not
    ``static``) a map may name a worker that has not joined yet."""
    names, counts, maps, devices = _read(infos)
    for node in names:
        mine = devices[node]
        if len(set(mine)) != len(mine):
            raise ValueError(f"Node {node} has duplicated devices\ndevices = {mine}\n"
                             f"Name each device once in set_devices.")
        if not _valid(mine, counts[node]):
            raise ValueError(f"Node {node} has devices with invalid indices\ndevices = {mine}\n"
                             f"device count = {counts[node]}\nName devices that worker has.")
    for source in names:
        unknown = sorted(set(maps[source]) - set(names))
        if static and unknown:
            raise ValueError(
                f"Node {source} has invalid target node names in its device maps\n"
                f"device maps = {list(maps[source])}\nnode names = {names}\n"
                f"No worker is named {', '.join(map(repr, unknown))}: set device maps for "
                f"workers of the group only.")
        for target, map_ in maps[source].items():
            _check_map(source, target, map_, counts, devices)


def _check_map(source: str, target: str, map_: Map, counts: Dict[str, int],
               devices: Dict[str, List[torch.device]]) -> None:
    where = f"in its device map for {target}\ndevice map = {map_}"
    if len(set(map_.values())) != len(map_):
        raise ValueError(f"Node {source} has duplicated target devices {where}\n"
                         f"Map each target device from one source only, so that replies "
                         f"can travel back through the inverse map.")
    if devices[source]:
        if not set(map_).issubset(devices[source]):
            raise ValueError(f"Node {source} has unexpected source devices {where}\n"
                             f"devices = {devices[source]}\nAdd them to set_devices.")
    elif not _valid(map_, counts[source]):
        raise ValueError(f"Node {source} has source devices with invalid indices {where}\n"
                         f"device count = {counts[source]}\nMap devices this worker has.")
    if devices.get(target):
        if not set(map_.values()).issubset(devices[target]):
            raise ValueError(f"Node {source} has unexpected target devices {where}\n"
                             f"devices = {devices[target]}\nAdd them to {target}'s "
                             f"set_devices.")
    elif target in counts and not _valid(map_.values(), counts[target]):
        raise ValueError(f"Node {source} has target devices with invalid indices {where}\n"
                         f"device count = {counts[target]}\nMap to devices {target} has.")
