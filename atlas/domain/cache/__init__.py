"""Per-sequence cache state: one manager per cache group, the radix prefix cache over them.

    CacheManager  (manager.py)     the one reserve / commit / release API the scheduler uses
      |- KvGroup        (groups.py)   paged KV of one (heads, head dim, window) group, its BlockPool
      |- StateSlotGroup (groups.py)   recurrent-state slots, one per running sequence
      '- RadixTree | NoPrefixCache (radix_tree.py)   full blocks of token ids -> pages, per group
"""
