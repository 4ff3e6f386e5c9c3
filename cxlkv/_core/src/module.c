/*
 * cxlkv._core._native: the only code that touches pool memory.
 *
 * This file is the module's Python face: its init, the ABI number, the
 * Mapping type with its method table and the table of module functions.
 * The functions live in the file of their concern: the Mapping object
 * (mapping.c), the cas-mode ticket lock (lock.c), the lock manager
 * (lockmgr.c), the host lock (hostlock.c), slab allocation (alloc.c,
 * slabs.c), the KV area (kv.c, lru.c, journal.c), the layout export
 * (layout.c), the crash points (crashpoint.c), the spill tier's read path
 * (spill.c); the argument helpers are
 * args.c, the shared declarations core.h.  Only the CPU wrappers and the
 * error types, a few lines each, are here.
 */
#include "core.h"

/* Bump when the Python-visible interface changes; cxlkv/_core/__init__.py
 * refuses to import a build with a different number (a stale build must fail
 * loudly, not strangely). */
#define CXLKV_NATIVE_ABI 24

PyObject *cxlkv_RangeError;   /* set by _native.set_error_types() */
PyObject *cxlkv_CorruptError; /* impossible pool metadata; set by set_error_types() */
PyObject *cxlkv_ReadOnlyError; /* a write to a read-only mapping; set by set_error_types() */
PyObject *cxlkv_InternalError; /* a broken invariant of cxlkv (a bug); set_error_types() */
PyObject *cxlkv_LockLostError; /* the pool lock was taken from this node; set_error_types() */

static PyObject *
mod_fence(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    (void)self;
    cxlkv_mfence();
    Py_RETURN_NONE;
}

static PyObject *
mod_sfence(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    (void)self;
    cxlkv_sfence();
    Py_RETURN_NONE;
}

static PyObject *
mod_cpu_info(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    (void)self;
    return Py_BuildValue("{s:s,s:O,s:O,s:O,s:O,s:O,s:s,s:s}",
                         "deadline_clock",
                         __atomic_load_n(&cxlkv_tsc_on, __ATOMIC_RELAXED) ? "tsc" : "clock",
                         "clflush", cxlkv_cpu.has_clflush ? Py_True : Py_False,
                         "clflushopt", cxlkv_cpu.has_clflushopt ? Py_True : Py_False,
                         "clwb", cxlkv_cpu.has_clwb ? Py_True : Py_False,
                         "avx2", cxlkv_cpu.has_avx2 ? Py_True : Py_False,
                         "avx512f", cxlkv_cpu.has_avx512f ? Py_True : Py_False,
                         "flush", cxlkv_flush_name(cxlkv_cpu.flush),
                         "invalidate", cxlkv_flush_name(cxlkv_cpu.invalidate));
}

static PyObject *
mod_deadline_tsc(PyObject *self, PyObject *arg)
{
    (void)self;
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    return PyBool_FromLong(cxlkv_deadline_tsc(on));
}

static PyObject *
mod_set_error_types(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *range, *corrupt, *ro, *internal, *lost;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!:set_error_types", &PyType_Type, &range,
                          &PyType_Type, &corrupt, &PyType_Type, &ro, &PyType_Type, &internal,
                          &PyType_Type, &lost))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)range, (PyTypeObject *)PyExc_IndexError) ||
        !PyType_IsSubtype((PyTypeObject *)corrupt, (PyTypeObject *)PyExc_ValueError) ||
        !PyType_IsSubtype((PyTypeObject *)ro, (PyTypeObject *)PyExc_PermissionError) ||
        !PyType_IsSubtype((PyTypeObject *)internal, (PyTypeObject *)PyExc_RuntimeError) ||
        !PyType_IsSubtype((PyTypeObject *)lost, (PyTypeObject *)PyExc_Exception)) {
        PyErr_SetString(PyExc_TypeError, "error types must subclass IndexError (range), "
                                         "ValueError (corrupt), PermissionError (read-only), "
                                         "RuntimeError (internal), Exception (lock lost)");
        return NULL;
    }
    Py_XSETREF(cxlkv_RangeError, Py_NewRef(range));
    Py_XSETREF(cxlkv_CorruptError, Py_NewRef(corrupt));
    Py_XSETREF(cxlkv_ReadOnlyError, Py_NewRef(ro));
    Py_XSETREF(cxlkv_InternalError, Py_NewRef(internal));
    Py_XSETREF(cxlkv_LockLostError, Py_NewRef(lost));
    Py_RETURN_NONE;
}

#define FAST(name, doc) {#name, (PyCFunction)(void (*)(void))Mapping_##name, METH_FASTCALL, doc}

static PyMethodDef Mapping_methods[] = {
    FAST(load64, "load64(off) -> int: atomic 64-bit load (acquire)"),
    FAST(store64, "store64(off, value): atomic 64-bit store (release)"),
    FAST(cas64, "cas64(off, expected, new) -> old: compare-and-swap; swapped iff old == expected"),
    FAST(fetch_add64, "fetch_add64(off, delta) -> old: atomic add modulo 2**64"),
    FAST(add64_many, "add64_many(off, delta, count) -> old: count atomic adds, GIL released"),
    FAST(ticket_acquire, "ticket_acquire(hdr, entry, token, epoch, spins, control_off, control) -> ticket if acquired | (ticket, serving) | None if fenced"),
    FAST(ticket_wait, "ticket_wait(hdr, entry, ticket, token, spins, control_off, control) -> (acquired, serving) | None if fenced; GIL released"),
    FAST(ticket_release, "ticket_release(hdr, entry, ticket, token, control_off, control) -> bool: False if it was not ours or the node was fenced (nothing written)"),
    FAST(mgr_loop, "mgr_loop(lock_hdr, nodes, max_nodes, state, table, boot_id, superblocks) -> reason: the lock manager's scan / grant / heartbeat loop until Python is needed (0 heartbeat or return time due, 1 slots, 2 guard, 3 step down, 4 Python step); GIL released"),
    FAST(mgr_wait, "mgr_wait(entry, req, spin_ns, sleep_max_ns, until_ns) -> 1 granted | 2 revoked | 0 until_ns passed; GIL released"),
    FAST(hostlock_acquire, "hostlock_acquire(off, mine, spins, wait_ns, since_ns) -> 0 when the host lock is ours, else the holder's word after up to wait_ns; GIL released while waiting (hostlock.c)"),
    FAST(hostlock_release, "hostlock_release(off, mine) -> bool: False if the word no longer names mine (taken over; nothing written)"),
    FAST(word_wait, "word_wait(off, seen, timeout_ns) -> the word's value once it is not seen, or seen after timeout_ns: a shared futex sleep, one host; GIL released (poolwait.c)"),
    FAST(word_wake, "word_wake(off) -> woken: wake every word_wait sleeper on off (poolwait.c)"),
    FAST(set_geometry, "set_geometry(data_off, chunk_size, nchunks, desc_base): allocator geometry"),
    FAST(slab_alloc, "slab_alloc(head, owner, out, count, zero, slot_size=0, heap=0) -> allocated | -1 (not our active slab of that size) | -2 (no hazard word free: call again holding the pool lock, heap=0)"),
    FAST(slab_free, "slab_free(offsets, zero, owner) -> freed (stops at a slab owner does not own - owner 0 = any - and once write_deadline_ns has passed, before a slot or between the pieces it zeroes one in, leaving that slot a begun free); raises ValueError at the first bad offset (MetadataCorrupt, also a ValueError, for a corrupt descriptor)"),
    FAST(slab_mark_freeing, "slab_mark_freeing(offsets) -> marked: set the dirty bit of allocated slots (a free has begun)"),
    FAST(slab_publish, "slab_publish(offsets) -> published"),
    FAST(chunk_find_run, "chunk_find_run(bitmap_off, k, hint) -> first of k free chunks (bitmap clear, descriptor FREE, in no head's span) from hint, wrapping once; -1 if none"),
    FAST(slab_make, "slab_make(bitmap_off, k, hint, owner, slot_size, nslots) -> head of a new slab of k chunks made at the first free run from hint (head, tails, bitmap bits, in recovery's order; crash points slab.head, slab.tails), or -1 if none (pool lock held), or -2 if the write deadline passed during the search (nothing written)"),
    FAST(prefault_range, "prefault_range(off, len) -> bool: map the 2 MiB granules of the range into this process now, as the first bulk copy into each would; False if prefaulting is off for this mapping (nothing done)"),
    FAST(slabs_release, "slabs_release(heads, bitmap_off, heaps_off, max_nodes) -> (released, looked_at): release_slab's protocol for each empty slab (released ones moved to the front of heads); stops early once the write deadline has passed - before a slab, or inside one leaving it RELEASING, which the next call finishes"),
    FAST(slabs_set_owner, "slabs_set_owner(heads, expect, owner) -> changed (moved to the front of heads): CAS the owner of HEAD slabs"),
    FAST(slab_census, "slab_census(bitmap_off, token, live) -> (releasing, mine, interrupted, dangling, leaked, empty): bytes of uint64 chunk indices from one pass over the descriptors (recovery)"),
    FAST(slab_take_emptied, "slab_take_emptied(freed=False) -> (bytes of uint64 heads, overflowed): slabs this process's frees emptied (freed=True: freed a slot in) since the last such call"),
    FAST(kv_lookup, "kv_lookup(table, nslots, ns, keys, out_idx, out_ctl, out_payload, out_len, stop_at_miss) -> found"),
    FAST(kv_insert, "kv_insert(table, nslots, hdr, max_used, ns, tenant, length, owner, keys, parent, payloads, out_idx, out_status) -> (processed, used, full); pool lock held"),
    FAST(kv_set_state, "kv_set_state(table, nslots, idx, from, to, owner, stamp, new_owner=0) -> changed; pool lock held"),
    FAST(kv_usage, "kv_usage(tenants, max_tenants, tenant) -> (bytes used by active tenants, tenant's quota, tenant's bytes used); pool lock held"),
    FAST(kv_account, "kv_account(ns_record, tenant_record, blocks, nbytes): add newly reserved blocks to both records' counts and nbytes to the tenant's bytes used; pool lock held"),
    FAST(node_fresh, "node_fresh(off, word, deadline_ns) -> True when CLOCK_MONOTONIC has not passed deadline_ns and the word at off (invalidated first) is `word`: the attached node's guard in one call"),
    FAST(kv_stamp, "kv_stamp(table, nslots, idx, stamp) -> stamped; pool lock held"),
    FAST(kv_in_flight, "kv_in_flight(table, nslots, out) -> found: entries in WRITING, PENDING or EVICTING (first len(out) indices to out)"),
    FAST(kv_remove, "kv_remove(table, nslots, hdr, idx) -> parent + 1; pool lock held"),
    FAST(kv_pin, "kv_pin(table, nslots, pins, npins, hint, idx, ctl, out) -> (pinned, hint, full)"),
    FAST(kv_unpin, "kv_unpin(pins, npins, records) -> cleared"),
    FAST(kv_touch, "kv_touch(head_off, ring_off, nring, idx) -> head"),
    FAST(journal_append, "journal_append(hdr, ring, nrec, table, nslots, op, writer, now_us, idx, ns=0) -> head; pool lock held"),
    FAST(kv_lru_setup, "kv_lru_setup(table, nslots, kv_hdr, links): where the leaf LRU lists are; the kv_* writers keep them from then on"),
    FAST(kv_lru_rebuild, "kv_lru_rebuild() -> leaves: relink every leaf from the table; pool lock held"),
    FAST(kv_lru_pick, "kv_lru_pick(tenant, want_n, want_bytes, smallest, pinned, keep, out) -> n: victims, LRU leaf first; pool lock held"),
    FAST(kv_lru_path_victim, "kv_lru_path_victim(key_lo, pinned, keep) -> idx | -1: LRU leaf on a key's probe path; pool lock held"),
    FAST(kv_lru_check, "kv_lru_check() -> (problems, first_problem, on_lists, leaves)"),
    FAST(kv_purge, "kv_purge(start, budget) -> (next_start, freed): bounded tombstone purge; pool lock held"),
    FAST(kv_evict_free, "kv_evict_free(hdr, rec_off, one, idx[, zero]) -> (freed, errors, failed): remove EVICTING victims and free their (marked) slots (zeroed unless zero is false), one by one, crash-safe; pool lock held; failed: (entry, message) of each free refused"),
    FAST(write_blocks, "write_blocks(offsets, src, block_bytes, nt=None) -> blocks written: block i of src to offsets[i]; flushed; stops before a block once write_deadline_ns passed"),
    FAST(read_blocks, "read_blocks(offsets, dst, block_bytes): offsets[i] to block i of dst"),
    FAST(kv_scatter, "kv_scatter(offsets, block_bytes, src_offset, buf, buf_offsets, shape, src_strides, buf_strides, run) -> blocks written: kv_copy's store walk straight into the pool slots at offsets (write copy mode, lines in memory on return); stops before a block once write_deadline_ns passed"),
    FAST(flush, "flush(off, length): write back the cache lines of a range, then fence"),
    FAST(invalidate, "invalidate(off, length): drop the cache lines of a range"),
    FAST(write, "write(off, buffer, nt=None): copy into the pool; flushed on return; a long one in 1 MiB pieces, the guard run between two once the write deadline passed (NodeFenced: partly written)"),
    FAST(zero, "zero(off, length, nt=None): zero a range; flushed on return; in pieces, as write"),
    FAST(read, "read(off, length) -> bytes"),
    FAST(readinto, "readinto(off, buffer) -> int: copy out of the pool"),
    FAST(view, "view(off, length, writable=False) -> memoryview (zero-copy; under CXLKV_NONCOHERENT=1 it shows the emulated cache, read-only)"),
    {"from_buffer", (PyCFunction)Mapping_from_buffer, METH_O | METH_CLASS,
     "from_buffer(obj) -> Mapping over an existing buffer (formatting without files, tests)"},
    {"close", (PyCFunction)Mapping_close, METH_NOARGS, "unmap; refused while views are alive"},
    {"host_memory", (PyCFunction)Mapping_host_memory, METH_NOARGS,
     "this mapping is host memory (the host lock file): never under the non-coherence emulation"},
    {"set_guard", (PyCFunction)Mapping_set_guard, METH_O,
     "set_guard(fn or None): called (GIL held) before any write once write_deadline_ns has "
     "passed; it proves the writer fresh or raises"},
    {"section_begin", (PyCFunction)Mapping_section_begin, METH_NOARGS,
     "count a section of the attached node in flight; False (nothing counted) once the "
     "write deadline is the fenced sentinel 1"},
    {"section_end", (PyCFunction)Mapping_section_end, METH_NOARGS,
     "end a section begun with section_begin"},
    {"nc_stats", (PyCFunction)Mapping_nc_stats, METH_NOARGS,
     "non-coherence emulation counters, or None when coherent"},
    {"__enter__", (PyCFunction)Mapping_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Mapping_exit, METH_VARARGS, NULL},
    {NULL},
};

static PyTypeObject MappingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cxlkv._core._native.Mapping",
    .tp_basicsize = sizeof(Mapping),
    .tp_dealloc = (destructor)Mapping_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Mapping(fd, size, writable=True, populate=False, align=0, offset=0): a pool mapped MAP_SHARED",
    .tp_methods = Mapping_methods,
    .tp_getset = Mapping_getset,
    .tp_new = Mapping_new,
};

static PyMethodDef module_methods[] = {
    {"fence", mod_fence, METH_NOARGS, "full memory fence (mfence)"},
    {"gather", (PyCFunction)(void (*)(void))mod_gather, METH_FASTCALL,
     "gather(blocks, dst, block_bytes) -> n: each buffer (or None) to its block of dst"},
    {"kv_copy", (PyCFunction)(void (*)(void))mod_kv_copy, METH_FASTCALL,
     "kv_copy(blocks, block_bytes, src_offset, buf, offsets, shape, src_strides, buf_strides, run, "
     "to_blocks=False) -> bytes: strided gather of blocks into buf (scatter back with "
     "to_blocks), one pass, GIL released, bounds-checked on both sides (gather.c)"},
    {"copy_modes", mod_copy_modes, METH_NOARGS,
     "copy_modes() -> {read: plain|nt, write: nt|clwb}: how bulk copies out of / into the pool store"},
    {"set_copy_modes", mod_set_copy_modes, METH_VARARGS,
     "set_copy_modes(read, write): read plain|nt, write nt|clwb (gather.c)"},
    {"kv_chain", (PyCFunction)(void (*)(void))mod_kv_chain, METH_FASTCALL,
     "kv_chain(tokens_u32, block_tokens, out) -> blocks: xxh3-128 chain of block hashes"},
    {"kv_keys", (PyCFunction)(void (*)(void))mod_kv_keys, METH_FASTCALL,
     "kv_keys(hashes, hash_len, prefix, out) -> n: pool keys xxh3-128(prefix || hash)"},
    {"spill_read", (PyCFunction)(void (*)(void))mod_spill_read, METH_FASTCALL,
     "spill_read(fd, meta, hdr_off, nslots, data_off, slot_bytes, slots, keys, ns_digest, length, "
     "bufs, read_bytes, snap=None, data=None) -> (ok, status, errno): read and verify a run of "
     "spill slots "
     "into bufs, GIL released, bounds-checked; stops at the first slot that fails (spill.c)"},
    {"spill_helpers", (PyCFunction)(void (*)(void))mod_spill_helpers, METH_FASTCALL,
     "spill_helpers(n, spin_us=None, caller_works=None) -> helpers: start or stop the helper "
     "threads that share spill_read's units with its caller (process-wide; spill_pool.c; "
     "None: unchanged)"},
    {"spill_helper_stats", mod_spill_helper_stats, METH_NOARGS,
     "the spill read helpers: their number (and asleep), spin, jobs posted and run alone, "
     "wake-ups, units each side ran"},
    {"spill_layout", mod_spill_layout, METH_NOARGS,
     "the spill slot header (spill_format.h) and spill_read's statuses"},
    {"crashpoint", mod_crashpoint, METH_O,
     "crashpoint(site): SIGKILL this process at the Nth pass when CXLKV_CRASH_AT=site:N, "
     "SIGSTOP it when CXLKV_PAUSE_AT=site:N"},
    {"sfence", mod_sfence, METH_NOARGS, "store fence"},
    {"cpu_info", mod_cpu_info, METH_NOARGS, "CPU features, the flush/invalidate instructions in use and the write deadline's clock"},
    {"deadline_tsc", mod_deadline_tsc, METH_O, "deadline_tsc(on) -> used: check write deadlines with the TSC where this CPU's is invariant (on: the kernel keeps time with it), else with clock_gettime"},
    {"layout", mod_layout, METH_NOARGS, "on-media structure offsets and sizes, from the C header"},
    {"constants", mod_constants, METH_NOARGS, "on-media constants, from the C header"},
    {"set_error_types", mod_set_error_types, METH_VARARGS,
     "set_error_types(range_error, corrupt_error, read_only_error, internal_error, "
     "lock_lost_error): the exception classes raised for out-of-range offsets, impossible "
     "pool metadata, writes to a read-only mapping, broken invariants (bugs) and a pool "
     "lock taken from this node"},
    {NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "cxlkv._core._native",
    "cxlkv C core: pool mapping, atomics, cache maintenance, copies.", -1, module_methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    cxlkv_cpu_init();
    cxlkv_prefault_atfork();
    if (PyType_Ready(&MappingType) < 0 || PyType_Ready(&SpanType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&native_module);
    if (!m)
        return NULL;
    cxlkv_RangeError = PyErr_NewException("cxlkv._core._native.RangeError", PyExc_IndexError, NULL);
    if (!cxlkv_RangeError)
        goto fail;
    Py_INCREF(cxlkv_RangeError);
    if (PyModule_AddObject(m, "RangeError", cxlkv_RangeError) < 0)
        goto fail;
    cxlkv_CorruptError = Py_NewRef(PyExc_ValueError);
    cxlkv_ReadOnlyError = Py_NewRef(PyExc_PermissionError);
    cxlkv_InternalError = Py_NewRef(PyExc_RuntimeError);
    cxlkv_LockLostError = Py_NewRef(PyExc_RuntimeError);
    Py_INCREF(&MappingType);
    if (PyModule_AddObject(m, "Mapping", (PyObject *)&MappingType) < 0)
        goto fail;
    if (PyModule_AddIntConstant(m, "ABI_VERSION", CXLKV_NATIVE_ABI) < 0)
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
