"""Small helpers every part uses: atomic files (files) and quiet output (third_party_warnings)."""
