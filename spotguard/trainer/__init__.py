"""spotguard.trainer."""
