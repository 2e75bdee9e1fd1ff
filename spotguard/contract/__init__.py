"""The in-pod contract between the operator's pods, the trainer and the uploader, named once.

The lowest floor of spotguard: the trainer (``spotguard.trainer``) and the
uploader (``spotguard.sidecar``, ``spotguard run``) both build on it, so neither
imports the other. :mod:`~spotguard.contract.env` names every ``SPOTGUARD_*``
environment variable once, with its type, default and parser;
:mod:`~spotguard.contract.control` holds the control files
they exchange (requests, acks, the trainer's pid and exit, the uploader's
heartbeat); :mod:`~spotguard.contract.retry` the backoff both sides use to
retry an upload; :mod:`~spotguard.contract.report` the sidecar's termination
report, which the operator reads. Standard library only.
"""
