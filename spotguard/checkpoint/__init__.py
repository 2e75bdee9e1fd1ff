"""spotguard.checkpoint."""
