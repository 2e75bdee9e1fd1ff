"""The tools room: what users run on checkpoints by hand.

``spotguard ckpt`` (:mod:`.cli`: list, verify, restore, retention, gc, export)
and the export of a checkpoint as a Hugging Face model folder (:mod:`.export`).

The top room: nothing in ``spotguard.checkpoint`` imports it.
"""
