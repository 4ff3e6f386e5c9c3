"""The KV cache's tiers beside the pool: a process's DRAM hot tier, its spill
store on local disk, and the rack's remote tier."""
