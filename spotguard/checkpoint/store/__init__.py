"""The store room: checkpoints in object storage, from upload to garbage collection.

The publish pipeline, in order: chunks uploaded once (:mod:`.chunked`), the
files and manifest uploaded (:mod:`.upload`), a multi-node checkpoint's parts
committed into one (:mod:`.parts`, :mod:`.global_manifest`), verified where it
lies (:mod:`.verify_stored`), and only then named by the ``latest`` pointer
(:mod:`.publish`, :mod:`.stored`). Readers find the newest verified checkpoint
(:mod:`.latest`); what is no longer needed goes by the retention plan
(:mod:`.retention`) and the sweep (:mod:`.gc`, with upload intents
:mod:`.intents` so a sweep never deletes a chunk an upload still needs);
chunks the store lost or damaged are forgotten and sent again (:mod:`.known`).

Imports the local and format rooms.
"""
