"""The KV cache's tiers beside the pool: a process's DRAM hot tier (`hot`),
its spill store on local disk (`spill`), and the rack's remote tier
(`remote`).  Each implements `base.Tier` and is owned by the pool object's
`base.Tiers` (`pool.tiers`); a tier's module is imported only when the tier
is enabled."""
