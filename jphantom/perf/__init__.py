"""Performance models: the cost of collectives (Seal et al. Eq. 26, Table III)."""
