"""Models: computation only. Every parallel layer comes from a strategy in jphantom.strategies."""
