"""The local room: the trainer's state into checkpoint files on this machine.

The state <-> files codec and the snapshot (:mod:`.codec`), which pages were
written since the last snapshot (:mod:`.written`), the atomic local commit and
listing (:mod:`.commit`), a preemption's save staged in memory
(:mod:`.staged`, :mod:`.arena`, :mod:`.reserve`), and chunks told unchanged
without hashing them (:mod:`.unchanged`).

Imports only the format room.
"""
