"""The packaged demo: a deterministic training script and the ``spotguard demo`` runner."""
