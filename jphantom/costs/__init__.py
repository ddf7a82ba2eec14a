"""What a program costs: the collectives each strategy's step moves, the program compiled ahead of
time for a device this machine lacks, and what a run measures every step: the designs' formulas
of each step's collectives (inventory.py); ``jphantom compile``'s ahead-of-time compilation
(aot.py); throughput, model FLOP/s and MFU, memory, energy (metrics.py)."""
