"""spotguard's version, named once, below every layer.

It imports nothing, so any module of spotguard can read the version without
pulling in the root package (whose ``__init__`` offers the trainer's public
names). ``spotguard.__version__`` re-exports it for users.
"""

from __future__ import annotations

__version__ = "0.1.0"
