"""Small helpers every part uses: atomic files (files), locks that need no flock (lock) and quiet
output (third_party_warnings)."""
