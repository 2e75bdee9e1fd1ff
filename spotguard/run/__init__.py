"""``spotguard run``: the checkpoint machinery without Kubernetes, for one machine (a rented spot GPU).

The supervisor (:mod:`spotguard.run.supervisor`) restores, runs the training
command, ships its checkpoints in-process with the sidecar's shipper and
handles SIGTERM and notices as the sidecar does; :mod:`spotguard.run.cli`
registers the command.
"""
