"""The unified radix tree and what hangs off it. Import the cache from ``tandem.cache.unified``."""

from tandem.cache.radix.components import FULL, SWA, Mamba, StateCopy, TreeComponent
from tandem.cache.radix.copier import KVCopier
from tandem.cache.radix.eviction import POLICIES, make_policy
from tandem.cache.radix.tree import Node, RadixTree

__all__ = ["FULL", "SWA", "Mamba", "StateCopy", "TreeComponent", "POLICIES", "make_policy",
           "KVCopier", "Node", "RadixTree"]
