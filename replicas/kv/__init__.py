"""A replica's prefix KV cache: block hashing, the block pool, the tiers (NPU, host, disk),
retention policies, copies between tiers, and the manager that matches and allocates blocks.

The router imports only ``hashing`` and ``events`` from here: nothing in this
package's ``__init__`` may import torch or the engine.
"""
