"""A replica's prefix KV cache: block hashing, the block pool, the tiers (NPU, host, disk),
retention policies, copies between tiers, and the manager that matches and allocates blocks
(``manager``) with its collaborators: ``reservations`` (waiting requests' prefixes held and
prefetched), ``onboarding`` (the disk tier's reads and stores), ``prompt_retention`` (retained
prompt prefixes) and ``views`` (events, snapshots, usage).

The router imports only ``hashing`` and ``events`` from here: nothing in this
package's ``__init__`` may import torch or the engine.
"""
