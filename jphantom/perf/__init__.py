"""Performance models: the cost of collectives (seed 000 Eq. 26, Table III)."""
