"""The wire layer: frame layout, message kinds and tensor-aware pickling. No I/O."""

from .frame import (FLAG_ONEWAY, FLAG_SHM, HEADER_SIZE, Frame, FrameDecoder, Header, Limits,
                    pack_header, parse_header, parse_lengths)
from .kinds import KNOWN_KINDS, Kind
from .serialize import PassThrough, current_context, decode, encode, memoryview_of, new_buffer, tensor_bytes

__all__ = [
    "FLAG_ONEWAY", "FLAG_SHM", "HEADER_SIZE", "Frame", "FrameDecoder", "Header", "Limits",
    "KNOWN_KINDS", "Kind", "current_context", "decode", "encode", "memoryview_of", "new_buffer",
    "PassThrough", "pack_header", "parse_header", "parse_lengths", "tensor_bytes",
]
