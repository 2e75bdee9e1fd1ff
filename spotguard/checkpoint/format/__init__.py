"""The format room: what a checkpoint is, read without running code.

The manifest (:mod:`.manifest`), how files split into content-addressed chunks
(:mod:`.chunks`), checking files against a manifest (:mod:`.verify`), and the
foreign formats a checkpoint may carry, read safely: legacy pickles
(:mod:`.pickle_scan`), ``torch.distributed.checkpoint`` metadata (:mod:`.dcp`)
and Hugging Face model folders (:mod:`.hf_folder`).

The lowest room of ``spotguard.checkpoint``: it imports no other room.
"""
