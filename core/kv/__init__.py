"""KV cache bookkeeping: block pool, block hashing, per-request allocation."""

from tokenbudget.core.kv.block_pool import BlockPool, KVCacheBlock
from tokenbudget.core.kv.hashing import BlockHasher
from tokenbudget.core.kv.manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheBlock", "BlockHasher", "KVCacheManager"]
