"""spotguard: keep long ML training runs alive on preemptible (spot) GPUs."""

__version__ = "0.1.0"
