"""Same-host shared memory for large buffers: a pool of reusable segments per connection.

Theory of operation. Two workers on one host (same boot, same IPC and mount
namespaces; see ``rendezvous.host_identity``) that both offered ``FEATURE_SHM`` in the
handshake move every buffer of at least ``threshold`` bytes through a shared segment
instead of the socket, where the receiver sees the sender's pids (below). The frame
then carries the segment's reference in the buffer's place (``_wire.frame``:
``SHM_BIT``, ``pack_shm_ref``).

A segment is a memfd: one header page, then the data. The sender of a connection owns
a pool of them (:class:`ShmSender`); the receiver maps each one once and keeps the
mapping (:class:`ShmReceiver`), so a segment used again costs neither a page
allocation nor a mapping:

* send: take a free segment big enough (or create one), mark it BUSY in its header,
  ``pwrite`` the buffer into it -- the one copy the sender makes -- and send its
  reference;
* receive: map the segment the first time its reference arrives; then wrap the data
  as a uint8 tensor, no copy. When the last tensor using that memory is freed, a
  finalizer marks the segment FREE in the shared header, and the sender may reuse it.
* send back: a buffer that lies in a segment the peer sent on this connection (an echo,
  or any reply that returns a received tensor or a view of it) is not copied: the
  frame carries a *return reference* (:func:`return_ref`: the segment's number and the
  buffer's offset). Before it sends one, the receiver counts the return in the
  segment's header (``_RETURNS``); the sender counts the returns it is done with, and
  reuses the segment only when every return it was sent is done and the receiver's
  own tensors are freed. A returned buffer must arrive as a copy would, owned by
  nobody else: the sender wraps it only once the receiver has freed its tensors on
  the segment (it waits for that about as long as copying would take, since the
  receiver usually frees them right after sending) and no other returned tensor is
  alive on it; otherwise it copies the bytes out.

The sender maps the data of a segment only when one comes back to it, so its own memory
does not grow with what it sends.

Segment states live in the header page, which both sides map: byte 0 is FREE or BUSY
(the sender sets BUSY before it sends, the receiver sets FREE when done), byte 1 is
RETIRED once the sender dropped the segment (idle, too small, or connection closed);
a receiver drops its mapping of a retired segment, and the memory goes back to the
system when the last tensor on it is freed.

Segments are memfds (anonymous files, ``memfd_create``): nothing is ever in
``/dev/shm``, and a segment's memory goes back to the system when the last process
that has it open or mapped is gone, however they die (all SIGKILLed at once
included). The sender seals every segment against shrinking and growing before it
sends its reference, and the receiver maps only a segment so sealed, of the size it
checked with ``fstat``: nobody can truncate a mapped segment, so a receiver never
meets SIGBUS. The reference a frame carries is the segment's name and the sender's
descriptor of it, ``<name>.<fd>``; the receiver opens ``/proc/<pid>/fd/<fd>`` (the
pid is in the name) and checks that the file it got is the memfd of that name.

A peer in another pid namespace cannot open this process's descriptors, so the
transport sends it no segments (its large buffers go over the socket), and a system
without memfds uses no shared memory at all (:func:`available`): no file is ever
created in ``/dev/shm``.
"""

from .segments import (HEADER, IDLE_RETIRE, MAX_FREE, MEMFD, PREFIX, Stats, _names,
                       available, is_return_ref, pid_namespace, process_state, return_ref)
from .shm_receiver import ShmReceiver
from .shm_sender import ShmSender

__all__ = ["HEADER", "IDLE_RETIRE", "MAX_FREE", "MEMFD", "PREFIX", "ShmReceiver", "ShmSender",
           "Stats", "_names", "available", "is_return_ref", "pid_namespace", "process_state",
           "return_ref"]
