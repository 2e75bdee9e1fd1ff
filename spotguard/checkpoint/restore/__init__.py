"""The restore room: a verified checkpoint from the store back into a trainer.

Download into a local directory, verified as it streams in (:mod:`.load`,
:mod:`.fetch`), straight into memory (:mod:`.stream`), and tensors read by name
from a stored checkpoint of any format spotguard knows (:mod:`.stored_tensors`).

Imports the store, local and format rooms.
"""
