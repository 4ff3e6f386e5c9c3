/*
 * The on-media format as Python sees it, from the one definition in
 * cxlkv_format.h: layout() gives every structure's size and field offsets
 * (offsetof), constants() the format's constants.  The Python mirror
 * (cxlkv/pool/layout.py) is checked against them and pinned by
 * tests/test_layout.py.
 */
#include "core.h"

/* layout() -> {struct: {"size": n, "fields": {name: (offset, size)}}} from offsetof() */
#define FIELD(d, S, f)                                                                   \
    do {                                                                                 \
        PyObject *t_ = Py_BuildValue("(nn)", (Py_ssize_t)offsetof(struct S, f),         \
                                     (Py_ssize_t)sizeof(((struct S *)0)->f));            \
        if (!t_ || PyDict_SetItemString(d, #f, t_) < 0) {                                \
            Py_XDECREF(t_);                                                              \
            goto fail;                                                                   \
        }                                                                                \
        Py_DECREF(t_);                                                                   \
    } while (0)

static int
add_struct(PyObject *out, const char *name, Py_ssize_t size, PyObject *fields)
{
    PyObject *d = Py_BuildValue("{s:n,s:O}", "size", size, "fields", fields);
    if (!d)
        return -1;
    int r = PyDict_SetItemString(out, name, d);
    Py_DECREF(d);
    return r;
}

PyObject *
mod_layout(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    (void)self;
    PyObject *out = PyDict_New(), *f = NULL;
    if (!out)
        return NULL;

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_superblock, magic);
    FIELD(f, cxlkv_superblock, version);
    FIELD(f, cxlkv_superblock, sb_size);
    FIELD(f, cxlkv_superblock, seq);
    FIELD(f, cxlkv_superblock, compat);
    FIELD(f, cxlkv_superblock, incompat);
    FIELD(f, cxlkv_superblock, ro_compat);
    FIELD(f, cxlkv_superblock, uuid);
    FIELD(f, cxlkv_superblock, pool_size);
    FIELD(f, cxlkv_superblock, ctime_ns);
    FIELD(f, cxlkv_superblock, sync_mode);
    FIELD(f, cxlkv_superblock, max_nodes);
    FIELD(f, cxlkv_superblock, chunk_size);
    FIELD(f, cxlkv_superblock, lease_ms);
    FIELD(f, cxlkv_superblock, hash_slots);
    FIELD(f, cxlkv_superblock, hash_max_load_pct);
    FIELD(f, cxlkv_superblock, flags);
    FIELD(f, cxlkv_superblock, nchunks);
    FIELD(f, cxlkv_superblock, regions);
    FIELD(f, cxlkv_superblock, tenant_secret);
    FIELD(f, cxlkv_superblock, label);
    FIELD(f, cxlkv_superblock, creator);
    FIELD(f, cxlkv_superblock, grace_ms);
    FIELD(f, cxlkv_superblock, name_tokens);
    FIELD(f, cxlkv_superblock, reserved);
    FIELD(f, cxlkv_superblock, checksum);
    if (add_struct(out, "superblock", sizeof(struct cxlkv_superblock), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_region, off);
    FIELD(f, cxlkv_region, size);
    if (add_struct(out, "region", sizeof(struct cxlkv_region), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_node, control);
    FIELD(f, cxlkv_node, heartbeat);
    FIELD(f, cxlkv_node, claim_token);
    FIELD(f, cxlkv_node, grant_token);
    FIELD(f, cxlkv_node, ack_epoch);
    FIELD(f, cxlkv_node, line0_pad);
    FIELD(f, cxlkv_node, pid);
    FIELD(f, cxlkv_node, start_time_ns);
    FIELD(f, cxlkv_node, attach_time_ns);
    FIELD(f, cxlkv_node, format_version);
    FIELD(f, cxlkv_node, flags);
    FIELD(f, cxlkv_node, boot_id);
    FIELD(f, cxlkv_node, hostname);
    FIELD(f, cxlkv_node, sw_version);
    FIELD(f, cxlkv_node, pidns);
    FIELD(f, cxlkv_node, ident_epoch);
    FIELD(f, cxlkv_node, reserved);
    FIELD(f, cxlkv_node, challenge);
    FIELD(f, cxlkv_node, challenge_epoch);
    FIELD(f, cxlkv_node, line4_pad);
    FIELD(f, cxlkv_node, answer);
    FIELD(f, cxlkv_node, answer_epoch);
    FIELD(f, cxlkv_node, answer_heartbeat);
    FIELD(f, cxlkv_node, line5_pad);
    FIELD(f, cxlkv_node, reserved6);
    FIELD(f, cxlkv_node, mgr_control);
    FIELD(f, cxlkv_node, mgr_grant_token);
    FIELD(f, cxlkv_node, line7_pad);
    if (add_struct(out, "node", sizeof(struct cxlkv_node), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_lock_hdr, next_ticket);
    FIELD(f, cxlkv_lock_hdr, line0_pad);
    FIELD(f, cxlkv_lock_hdr, now_serving);
    FIELD(f, cxlkv_lock_hdr, owner);
    FIELD(f, cxlkv_lock_hdr, acquisitions);
    FIELD(f, cxlkv_lock_hdr, line1_pad);
    FIELD(f, cxlkv_lock_hdr, mgr_token);
    FIELD(f, cxlkv_lock_hdr, mgr_epoch);
    FIELD(f, cxlkv_lock_hdr, mgr_heartbeat);
    FIELD(f, cxlkv_lock_hdr, mgr_pid);
    FIELD(f, cxlkv_lock_hdr, mgr_boot_id);
    FIELD(f, cxlkv_lock_hdr, mgr_hostname);
    FIELD(f, cxlkv_lock_hdr, mgr_recovering);
    FIELD(f, cxlkv_lock_hdr, mgr_pidns);
    FIELD(f, cxlkv_lock_hdr, reserved);
    if (add_struct(out, "lock_hdr", sizeof(struct cxlkv_lock_hdr), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_lock_entry, state);
    FIELD(f, cxlkv_lock_entry, ticket);
    FIELD(f, cxlkv_lock_entry, epoch);
    FIELD(f, cxlkv_lock_entry, req_seq);
    FIELD(f, cxlkv_lock_entry, release_seq);
    FIELD(f, cxlkv_lock_entry, freeing);
    FIELD(f, cxlkv_lock_entry, held_when_fenced);
    FIELD(f, cxlkv_lock_entry, recovering);
    FIELD(f, cxlkv_lock_entry, grant_seq);
    FIELD(f, cxlkv_lock_entry, revoke_seq);
    FIELD(f, cxlkv_lock_entry, grant_epoch);
    FIELD(f, cxlkv_lock_entry, line1_pad);
    if (add_struct(out, "lock_entry", sizeof(struct cxlkv_lock_entry), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_chunk, control);
    FIELD(f, cxlkv_chunk, owner);
    FIELD(f, cxlkv_chunk, slot_size);
    FIELD(f, cxlkv_chunk, nslots);
    FIELD(f, cxlkv_chunk, nchunks);
    FIELD(f, cxlkv_chunk, pad);
    FIELD(f, cxlkv_chunk, alloc_bits);
    FIELD(f, cxlkv_chunk, pub_bits);
    FIELD(f, cxlkv_chunk, dirty_bits);
    if (add_struct(out, "chunk", sizeof(struct cxlkv_chunk), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_heap, hazard);
    FIELD(f, cxlkv_heap, reserved);
    if (add_struct(out, "heap", sizeof(struct cxlkv_heap), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_hash_entry, ctl);
    FIELD(f, cxlkv_hash_entry, key_lo);
    FIELD(f, cxlkv_hash_entry, key_hi);
    FIELD(f, cxlkv_hash_entry, payload);
    FIELD(f, cxlkv_hash_entry, length);
    FIELD(f, cxlkv_hash_entry, ns);
    FIELD(f, cxlkv_hash_entry, tenant);
    FIELD(f, cxlkv_hash_entry, parent);
    FIELD(f, cxlkv_hash_entry, children);
    FIELD(f, cxlkv_hash_entry, owner);
    FIELD(f, cxlkv_hash_entry, lru);
    if (add_struct(out, "hash_entry", sizeof(struct cxlkv_hash_entry), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_kv_hdr, magic);
    FIELD(f, cxlkv_kv_hdr, max_namespaces);
    FIELD(f, cxlkv_kv_hdr, max_tenants);
    FIELD(f, cxlkv_kv_hdr, pins_per_node);
    FIELD(f, cxlkv_kv_hdr, ring_per_node);
    FIELD(f, cxlkv_kv_hdr, ns_off);
    FIELD(f, cxlkv_kv_hdr, tenant_off);
    FIELD(f, cxlkv_kv_hdr, node_off);
    FIELD(f, cxlkv_kv_hdr, node_stride);
    FIELD(f, cxlkv_kv_hdr, line0_pad);
    FIELD(f, cxlkv_kv_hdr, live);
    FIELD(f, cxlkv_kv_hdr, tombstones);
    FIELD(f, cxlkv_kv_hdr, evictions);
    FIELD(f, cxlkv_kv_hdr, evicted_bytes);
    FIELD(f, cxlkv_kv_hdr, line1_pad);
    FIELD(f, cxlkv_kv_hdr, lru_off);
    FIELD(f, cxlkv_kv_hdr, lru_dirty);
    FIELD(f, cxlkv_kv_hdr, lru_leaves);
    FIELD(f, cxlkv_kv_hdr, lru_rebuilds);
    FIELD(f, cxlkv_kv_hdr, purge_cursor);
    FIELD(f, cxlkv_kv_hdr, line2_pad);
    FIELD(f, cxlkv_kv_hdr, lru_lists);
    FIELD(f, cxlkv_kv_hdr, reserved);
    if (add_struct(out, "kv_hdr", sizeof(struct cxlkv_kv_hdr), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_kv_stats, lookups);
    FIELD(f, cxlkv_kv_stats, hit_blocks);
    FIELD(f, cxlkv_kv_stats, miss_blocks);
    FIELD(f, cxlkv_kv_stats, stored_blocks);
    FIELD(f, cxlkv_kv_stats, present_blocks);
    FIELD(f, cxlkv_kv_stats, stored_bytes);
    FIELD(f, cxlkv_kv_stats, loaded_blocks);
    FIELD(f, cxlkv_kv_stats, loaded_bytes);
    if (add_struct(out, "kv_stats", sizeof(struct cxlkv_kv_stats), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_kv_ns, name);
    FIELD(f, cxlkv_kv_ns, state);
    FIELD(f, cxlkv_kv_ns, hash_kind);
    FIELD(f, cxlkv_kv_ns, block_tokens);
    FIELD(f, cxlkv_kv_ns, reserved0);
    FIELD(f, cxlkv_kv_ns, block_bytes);
    FIELD(f, cxlkv_kv_ns, digest);
    FIELD(f, cxlkv_kv_ns, blocks);
    FIELD(f, cxlkv_kv_ns, evictions);
    FIELD(f, cxlkv_kv_ns, evicted_bytes);
    FIELD(f, cxlkv_kv_ns, stats);
    if (add_struct(out, "kv_ns", sizeof(struct cxlkv_kv_ns), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_kv_tenant, salt);
    FIELD(f, cxlkv_kv_tenant, state);
    FIELD(f, cxlkv_kv_tenant, reserved0);
    FIELD(f, cxlkv_kv_tenant, quota);
    FIELD(f, cxlkv_kv_tenant, used);
    FIELD(f, cxlkv_kv_tenant, blocks);
    FIELD(f, cxlkv_kv_tenant, rejected);
    FIELD(f, cxlkv_kv_tenant, reserved1);
    if (add_struct(out, "kv_tenant", sizeof(struct cxlkv_kv_tenant), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_kv_node, ring_head);
    FIELD(f, cxlkv_kv_node, line0_pad);
    FIELD(f, cxlkv_kv_node, ring_drained);
    FIELD(f, cxlkv_kv_node, line1_pad);
    if (add_struct(out, "kv_node", sizeof(struct cxlkv_kv_node), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_journal_hdr, magic);
    FIELD(f, cxlkv_journal_hdr, records_per_node);
    FIELD(f, cxlkv_journal_hdr, rec_size);
    FIELD(f, cxlkv_journal_hdr, ring_off);
    FIELD(f, cxlkv_journal_hdr, ring_stride);
    FIELD(f, cxlkv_journal_hdr, max_nodes);
    FIELD(f, cxlkv_journal_hdr, line0_pad);
    FIELD(f, cxlkv_journal_hdr, next_seq);
    FIELD(f, cxlkv_journal_hdr, line1_pad);
    if (add_struct(out, "journal_hdr", sizeof(struct cxlkv_journal_hdr), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_journal_ring, head);
    FIELD(f, cxlkv_journal_ring, writer);
    FIELD(f, cxlkv_journal_ring, pad);
    if (add_struct(out, "journal_ring", sizeof(struct cxlkv_journal_ring), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_journal_rec, seq);
    FIELD(f, cxlkv_journal_rec, key_lo);
    FIELD(f, cxlkv_journal_rec, key_hi);
    FIELD(f, cxlkv_journal_rec, parent_lo);
    FIELD(f, cxlkv_journal_rec, parent_hi);
    FIELD(f, cxlkv_journal_rec, length);
    FIELD(f, cxlkv_journal_rec, ns);
    FIELD(f, cxlkv_journal_rec, tenant);
    FIELD(f, cxlkv_journal_rec, time_us);
    FIELD(f, cxlkv_journal_rec, entry);
    FIELD(f, cxlkv_journal_rec, op);
    FIELD(f, cxlkv_journal_rec, reserved);
    if (add_struct(out, "journal_rec", sizeof(struct cxlkv_journal_rec), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_block_name, key_lo);
    FIELD(f, cxlkv_block_name, key_hi);
    FIELD(f, cxlkv_block_name, len);
    FIELD(f, cxlkv_block_name, ntokens);
    FIELD(f, cxlkv_block_name, name);
    if (add_struct(out, "block_name", sizeof(struct cxlkv_block_name), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_badchunk_hdr, magic);
    FIELD(f, cxlkv_badchunk_hdr, count);
    FIELD(f, cxlkv_badchunk_hdr, capacity);
    FIELD(f, cxlkv_badchunk_hdr, retired_bytes);
    FIELD(f, cxlkv_badchunk_hdr, metadata_hits);
    if (add_struct(out, "badchunk_hdr", sizeof(struct cxlkv_badchunk_hdr), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_badchunk, chunk);
    FIELD(f, cxlkv_badchunk, offset);
    FIELD(f, cxlkv_badchunk, length);
    FIELD(f, cxlkv_badchunk, reason);
    FIELD(f, cxlkv_badchunk, region);
    FIELD(f, cxlkv_badchunk, time_ns);
    if (add_struct(out, "badchunk", sizeof(struct cxlkv_badchunk), f) < 0)
        goto fail;
    Py_CLEAR(f);
    return out;
fail:
    Py_XDECREF(f);
    Py_DECREF(out);
    return NULL;
}

PyObject *
mod_constants(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    (void)self;
#define C(name) {#name, (unsigned long long)CXLKV_##name}
    static const struct { const char *name; unsigned long long v; } tab[] = {
        C(FORMAT_VERSION), C(SB_SIZE), C(SB_COPIES), C(SYNC_CAS), C(SYNC_MANAGER),
        C(REGION_NODES), C(REGION_LOCKS), C(REGION_BITMAP), C(REGION_HEAPS), C(REGION_HASH),
        C(REGION_DATA), C(REGION_KV), C(REGION_COUNT), C(NODE_SIZE), C(LOCK_HDR_SIZE),
        C(LOCK_ENTRY_SIZE), C(HEAP_SIZE), C(CHUNK_DESC_SIZE), C(HASH_ENTRY_SIZE),
        C(NODE_FREE), C(NODE_CLAIMED), C(NODE_ATTACHED), C(NODE_FENCED), C(NODE_FLAG_KV_EVENTS),
        C(LOCK_IDLE), C(LOCK_WAITING), C(LOCK_LOCKED), C(LOCK_ABANDONED),
        C(CHUNK_FREE), C(CHUNK_HEAD), C(CHUNK_TAIL), C(CHUNK_RELEASING), C(SLAB_MAX_SLOTS),
        C(HEAP_HAZARDS),
        C(FEATURE_COMPAT_KV), C(FEATURE_COMPAT_NAMES), C(FEATURE_COMPAT_SUPP), C(NAME_SIZE), C(NAME_MAX), C(NAME_TOKENS_MAX), C(FEATURE_INCOMPAT_SUPP),
        C(FEATURE_INCOMPAT_KV_LRU), C(KV_LRU_LISTS),
        C(FEATURE_RO_COMPAT_SUPP),
        C(KV_EMPTY), C(KV_WRITING), C(KV_PENDING), C(KV_PUBLISHED), C(KV_EVICTING),
        C(KV_TOMBSTONE), C(KV_MAGIC), C(KV_HDR_SIZE), C(KV_NS_SIZE), C(KV_TENANT_SIZE),
        C(KV_NS_NAME), C(KV_NSTATS), C(KV_REC_FREE), C(KV_REC_ACTIVE),
        C(KV_HASH_XXH3_128), C(KV_HASH_SHA256_CBOR),
        C(FEATURE_INCOMPAT_JOURNAL), C(JOURNAL_MAGIC), C(JOURNAL_REC_SIZE), C(JOURNAL_STORED),
        C(JOURNAL_EVICTED), C(JOURNAL_NS_CLEARED),
        C(FEATURE_INCOMPAT_BADCHUNKS), C(BADCHUNK_MAGIC), C(BADCHUNK_LIST_OFF),
        C(BADCHUNK_NO_CHUNK), C(BADCHUNK_POISON), C(BADCHUNK_MEDIA_ERROR), C(BADCHUNK_MANUAL),
    };
#undef C
    PyObject *d = PyDict_New(), *v;
    if (!d)
        return NULL;
    v = PyBytes_FromStringAndSize(CXLKV_MAGIC, 8);
    if (!v || PyDict_SetItemString(d, "MAGIC", v) < 0)
        goto fail;
    Py_DECREF(v);
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++) {
        v = PyLong_FromUnsignedLongLong(tab[i].v);
        if (!v || PyDict_SetItemString(d, tab[i].name, v) < 0)
            goto fail;
        Py_DECREF(v);
    }
    return d;
fail:
    Py_XDECREF(v);
    Py_DECREF(d);
    return NULL;
}
