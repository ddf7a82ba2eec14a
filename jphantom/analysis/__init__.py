"""Reading compiled XLA programs: collectives, FLOPs and memory of a training step."""
