"""spotguard.storage."""
