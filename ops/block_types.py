"""GGUF block types the CPU kernels read (ops/quant.py) -> (weights, bytes) per block; without torch,
so the loader's GGUF reader can ask it too. Q4_K's super-blocks are read as eight 32-weight
Q4_1-style blocks, each with its own d and m; the 5-, 6- and 2-bit types as signed bytes with their
scales (and mins)."""
BLOCK_TYPES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q5_0": (32, 22), "Q5_1": (32, 24),
               "Q2_K": (256, 84), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
