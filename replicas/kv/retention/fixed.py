"""The fixed retention policy (``retention="fixed"``): the write-through threshold and
write-back as configured.

A block whose NPU hits reach the threshold is copied to host at once; with write-back, a block
the NPU tier evicts with no host copy is stored first, and with a disk tier the block the host
tier evicts is stored to disk first. Without write-back, neither.
"""

from replicas.kv.hashing import BlockHash
from replicas.kv.retention.policy import PolicyContext, RetentionPolicy, register_policy

OFF, ON = "off", "on"
"""The fixed policy's points on the miss-ratio curve: write-back off and on."""


@register_policy("fixed")
class FixedPolicy(RetentionPolicy):
    __slots__ = ("curve_name", "may_store_to_disk", "write_back")

    decides_at_eviction = False

    def __init__(self, context: PolicyContext) -> None:
        self.write_back = context.write_back
        self.may_store_to_disk = context.write_back
        self.curve_name = ON if context.write_back else OFF

    def should_store(self, block_hash: BlockHash, num_hits: int, host_full: bool) -> bool:
        return self.write_back

    def should_store_to_disk(self, disk_read_s: float) -> bool:
        return self.write_back
