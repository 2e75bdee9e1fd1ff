"""spotguard.sidecar."""
