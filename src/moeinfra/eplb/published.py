"""DeepSeek's published EPLB example (README of its release; REFERENCE.md): 2 layers, 12 experts,
16 replicas, 4 groups, 2 nodes, 8 GPUs. Used by the tests and the demo report."""

import numpy as np

EXAMPLE_ARGS = {"num_replicas": 16, "num_groups": 4, "num_nodes": 2, "num_gpus": 8}
EXAMPLE_WEIGHT = np.array(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
EXAMPLE_PHY2LOG = np.array(
    [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
)
