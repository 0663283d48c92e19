"""The wire layer: frame layout, message kinds and tensor-aware pickling. No I/O."""

from .frame import (FLAG_MANY, FLAG_ONCE, FLAG_ONEWAY, FLAG_SHM, FLAG_STRIPED, HEADER_SIZE,
                    SHM_BIT, SHM_REF_SIZE, Header, Limits, pack_header, pack_shm_ref, parse_header,
                    parse_lengths, parse_shm_ref)
from .kinds import KNOWN_KINDS, PAYLOAD_NAMES, Kind
from .pickler import device_maps_move_cpu
from .probe import MAX_PROBE_IDS, pack_probe, pack_status, parse_probe, parse_status
from .serialize import (INLINE_MAX, OUT_OF_BAND_MIN, PassThrough, Placed, decode, encode,
                        memoryview_of,
                        new_buffer, prepare_encode, register_message_reducer, register_rebuilder,
                        tensor_bytes)

__all__ = [
    "FLAG_MANY", "FLAG_ONCE", "FLAG_ONEWAY", "FLAG_SHM", "FLAG_STRIPED", "HEADER_SIZE", "SHM_BIT",
    "SHM_REF_SIZE", "Header", "Limits", "pack_shm_ref", "parse_shm_ref",
    "KNOWN_KINDS", "Kind", "PAYLOAD_NAMES", "decode", "device_maps_move_cpu", "encode",
    "INLINE_MAX", "memoryview_of", "new_buffer", "OUT_OF_BAND_MIN", "PassThrough", "Placed",
    "pack_header",
    "parse_header", "parse_lengths", "prepare_encode", "register_message_reducer",
    "register_rebuilder",
    "tensor_bytes",
    "MAX_PROBE_IDS", "pack_probe", "pack_status", "parse_probe", "parse_status",
]
