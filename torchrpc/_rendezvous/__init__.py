"""Rendezvous: how the workers of a group find each other through torch's stores.

Store protocols only, no threads and no sockets of ours: the job secret
(:mod:`.secret`), the sealed records every other protocol reads and writes
(:mod:`.records`, :class:`~.group_store.Records`), the static group's rendezvous
(:mod:`.rendezvous`), a dynamic group's membership log and claims (:mod:`.membership`),
the shutdown barriers (:mod:`.barriers`) and what a worker name may be (:mod:`.names`).
The agent (``torchrpc._agent``) drives them; the store is untrusted throughout.
"""
