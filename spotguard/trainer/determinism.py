"""Deterministic kernels, switched on at the cost of a flag.

A bit-exact resume needs the same kernels on both sides of a preemption:
``torch.use_deterministic_algorithms(True)``. That function also sets the
compiler's ``torch._inductor.config.deterministic``, and so imports
``torch._inductor`` and ``torch._dynamo``: about 3 s of CPU at the start of
every process, compiled or not (a restarted pod pays it inside its
preemption budget). :func:`deterministic` ends in the same state without the
import: the process-wide flag through the same call the public function
makes, and the compiler's setting through the environment variable its
config reads when it is first imported (``TORCHINDUCTOR_DETERMINISTIC``).
Where the compiler is already imported, it simply calls the public function.
"""

from __future__ import annotations

import os
import sys


def deterministic(*, warn_only: bool = False) -> None:
    """Make torch choose deterministic kernels (and raise on ops that have none, unless ``warn_only``).

    Also sets ``CUBLAS_WORKSPACE_CONFIG`` (unless set), without which CUDA's
    deterministic matrix products refuse to run. Call it before the first CUDA op.
    """
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        return
    os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"  # read when the compiler is first imported
    torch._C._set_deterministic_algorithms(True, warn_only=warn_only)
