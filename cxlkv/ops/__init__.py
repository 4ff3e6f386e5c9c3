"""Operations: what the commands do (init, fsck, repair, report, health, doctor,
provision, stress), over the pool, its shared state and the KV cache."""
