"""RRefs: the Remote Reference Protocol's bookkeeping (sans I/O) and its agent layer."""

from .book import GloballyUniqueId, Msg, OwnerEntry, RRefBook
from .layer import RRefLayer, delete_all_users, install, live_users, remote
from .rref import RREF_LAYER, RRef

__all__ = ["RREF_LAYER", "GloballyUniqueId", "Msg", "OwnerEntry", "RRef", "RRefBook", "RRefLayer",
           "delete_all_users", "install", "live_users", "remote"]
