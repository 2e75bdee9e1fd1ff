"""spotguard.operator."""
