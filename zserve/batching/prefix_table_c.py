"""The C source of ``zserve.batching.prefix_table``'s index (a CPython extension module, built on first use).

What it keeps is ``zserve.batching.prefix_index.PrefixIndex``'s, for at most 64 engines (a mask is one uint64):
block hash -> mask of the engines' slots holding it, in one flat open-addressing table of (hash, mask) pairs
(16 bytes a slot, linear probing from a home keyed by a random seed, backward-shift deletion so no tombstones build
up; hash 0 is kept apart, 0 marks an empty slot), and per engine its slot, count, bound and log (the hashes it
stored, oldest first, as uint64: no Python int per entry). One probe reads one cache line, where a dict's reads
three (its index, its entry, the key int), and a step's deltas or a request's choice is one call.

Hashes are read as 64-bit unsigned ints (modulo 2**64: what the wire carries and ``prefix_hash`` makes).
The memory is PyMem_Raw*'s, so tracemalloc counts it as it counts the dict index's.
"""

SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define SLOTS 64
#define EMPTY 0

typedef struct { uint64_t key, mask; } entry_t;
typedef struct {
    PyObject *engine;  /* NULL: a free slot */
    uint64_t *log;
    Py_ssize_t len, cap, count, limit;
} held_t;
typedef struct {
    PyObject_HEAD
    entry_t *t;
    uint64_t cap, used;  /* cap: a power of two; used: keys present */
    int shift;           /* 64 - log2(cap) */
    uint64_t zero;       /* the mask of hash 0 (0 is an empty slot's key) */
    uint64_t seed;       /* keys the home slots (see home) */
    PyObject *slot_of;   /* engine -> its slot (a Python int) */
    held_t held[SLOTS];
} Index;

static PyObject *s_worker_id, *s_free_credits, *s_in_flight, *s_match, *s_spill, *s_least;

/* A key's home slot: the top bits of MurmurHash3's finaliser of the key keyed by this index's random seed. Block
   hashes are public (anyone can compute a prompt's), so an unkeyed home (the top bits of h * 2^64/phi, as before)
   let a client grind prompts whose blocks share one home: one probe run of thousands of slots that every lookup
   landing in it scans (83 us a route, was 2.5). */
static inline uint64_t home(const Index *s, uint64_t h) {
    h ^= s->seed;
    h ^= h >> 33; h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33; h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h >> s->shift;
}

/* The mask of h's entry, or NULL where h has none. */
static inline uint64_t *find(Index *s, uint64_t h) {
    if (h == EMPTY) return &s->zero;
    uint64_t m = s->cap - 1, j = home(s, h);
    for (;;) {
        entry_t *e = &s->t[j];
        if (e->key == h) return &e->mask;
        if (e->key == EMPTY) return NULL;
        j = (j + 1) & m;
    }
}
static inline uint64_t get(Index *s, uint64_t h) { uint64_t *p = find(s, h); return p ? *p : 0; }

static int resize(Index *s, uint64_t cap) {
    entry_t *old = s->t, *t = PyMem_RawCalloc(cap, sizeof(entry_t));
    uint64_t oc = s->cap;
    if (!t) { PyErr_NoMemory(); return -1; }
    s->t = t; s->cap = cap; s->shift = 64 - __builtin_ctzll(cap);
    for (uint64_t i = 0; i < oc; i++) if (old[i].key != EMPTY) {
        uint64_t j = home(s, old[i].key);
        while (t[j].key != EMPTY) j = (j + 1) & (cap - 1);
        t[j] = old[i];
    }
    PyMem_RawFree(old);
    return 0;
}

/* The mask of h's entry, made (0) if it had none; NULL on no memory. The table stays under half full. */
static uint64_t *insert(Index *s, uint64_t h) {
    if (h == EMPTY) return &s->zero;
    uint64_t *p = find(s, h);
    if (p) return p;
    if ((s->used + 1) * 2 > s->cap && resize(s, s->cap * 2)) return NULL;
    uint64_t m = s->cap - 1, j = home(s, h);
    while (s->t[j].key != EMPTY) j = (j + 1) & m;
    s->t[j].key = h; s->t[j].mask = 0; s->used++;
    return &s->t[j].mask;
}

/* h's entry goes (it must have one); the entries after it in its run move back where their probe allows. */
static void erase(Index *s, uint64_t h) {
    if (h == EMPTY) { s->zero = 0; return; }
    uint64_t m = s->cap - 1, i = home(s, h);
    while (s->t[i].key != h) i = (i + 1) & m;
    for (uint64_t j = i;;) {
        j = (j + 1) & m;
        if (s->t[j].key == EMPTY) break;
        uint64_t k = home(s, s->t[j].key);
        if (i <= j ? (i < k && k <= j) : (i < k || k <= j)) continue;  /* its home is after the hole: it stays */
        s->t[i] = s->t[j]; i = j;
    }
    s->t[i].key = EMPTY; s->t[i].mask = 0; s->used--;
}

/* Clear bit in h's mask; the entry goes with its last bit. Returns whether the bit was set. */
static inline int clear(Index *s, uint64_t h, uint64_t bit) {
    uint64_t *p = find(s, h);
    if (!p || !(*p & bit)) return 0;
    if (*p == bit) erase(s, h); else *p ^= bit;
    return 1;
}

/* A hash: an int (modulo 2**64). Nothing else is taken: another type's __index__ would run Python code, which may
   change the sequence whose items a caller is reading. */
static inline int key_of(PyObject *o, uint64_t *h) {
    if (!PyLong_Check(o)) { PyErr_SetString(PyExc_TypeError, "a block hash must be an int"); return -1; }
    *h = PyLong_AsUnsignedLongLongMask(o);
    return (*h == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 0;
}

static int slot_of(Index *s, PyObject *engine) {  /* -1: not indexed (no error set), -2: an error */
    PyObject *o = PyDict_GetItemWithError(s->slot_of, engine);
    if (!o) return PyErr_Occurred() ? -2 : -1;
    return (int)PyLong_AsLong(o);
}

static int log_append(held_t *e, uint64_t h) {
    if (e->len == e->cap) {
        /* 2 * limit + 64, saturated (the wrapper bounds limit far below; _reset may be called with any) */
        Py_ssize_t cap = e->cap ? e->cap * 2 : 64;
        Py_ssize_t most = e->limit > (PY_SSIZE_T_MAX - 64) / 2 ? PY_SSIZE_T_MAX : 2 * e->limit + 64;
        if (cap > most) cap = most > e->len ? most : e->len + 64;  /* no more than compaction lets it hold */
        uint64_t *log = PyMem_RawRealloc(e->log, cap * sizeof(uint64_t));
        if (!log) { PyErr_NoMemory(); return -1; }
        e->log = log; e->cap = cap;
    }
    e->log[e->len++] = h;
    return 0;
}

/* Forget an engine's ``over`` oldest entries (deltas were lost: more than its pool holds). */
static void trim(Index *s, held_t *e, uint64_t bit, Py_ssize_t over) {
    Py_ssize_t i = 0;
    while (over > 0) {
        if (clear(s, e->log[i++], bit)) { over--; e->count--; }
    }
    memmove(e->log, e->log + i, (e->len - i) * sizeof(uint64_t));
    e->len -= i;
}

/* The log keeps the hashes the engine holds, each once, first stored first (as dict.fromkeys keeps them): a
   hash is kept when its bit is set, and the bit cleared until all are kept, so a second copy is passed over. */
static void compact(Index *s, held_t *e, uint64_t bit) {
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < e->len; i++) {
        uint64_t *p = find(s, e->log[i]);
        if (p && (*p & bit)) { *p ^= bit; e->log[n++] = e->log[i]; }
    }
    for (Py_ssize_t i = 0; i < n; i++) *find(s, e->log[i]) |= bit;  /* no insert or erase between: found */
    e->len = n;
}

/* Start loading the table's line for block i's hash: the search's next probe is one of two known ones, so
   both are asked for before the current one is read, and a probe waits for memory once, not once a level. */
static inline void prefetch(Index *s, PyObject *const *hs, Py_ssize_t i) {
    if (PyLong_CheckExact(hs[i])) {
        uint64_t h = PyLong_AsUnsignedLongLongMask(hs[i]);
        __builtin_prefetch(&s->t[home(s, h)]);
    }
}

static int apply(Index *s, int slot, PyObject *stored, PyObject *evicted) {
    held_t *e = &s->held[slot];
    uint64_t bit = 1ULL << slot, h;
    PyObject *ev = PySequence_Fast(evicted, "evicted: hashes"), *st = NULL;
    if (!ev) return -1;
    if (!(st = PySequence_Fast(stored, "stored: hashes"))) goto fail;
    /* every hash's line asked for at once: their misses overlap, where probing them in turn waits for each */
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(ev); i++) prefetch(s, PySequence_Fast_ITEMS(ev), i);
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(st); i++) prefetch(s, PySequence_Fast_ITEMS(st), i);
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(ev); i++) {
        if (key_of(PySequence_Fast_GET_ITEM(ev, i), &h)) goto fail;
        if (clear(s, h, bit)) e->count--;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(st); i++) {
        if (key_of(PySequence_Fast_GET_ITEM(st, i), &h)) goto fail;
        uint64_t *p = insert(s, h);
        if (!p) goto fail;
        if (!(*p & bit)) {
            *p |= bit; e->count++;
            if (log_append(e, h)) goto fail;
        }
    }
    Py_DECREF(ev); Py_DECREF(st);
    if (e->count > e->limit) trim(s, e, bit, e->count - e->limit);
    else if (e->len - e->limit > e->limit) compact(s, e, bit);  /* len > 2 limit, without overflow */
    return 0;
fail:
    Py_DECREF(ev); Py_XDECREF(st);
    return -1;
}

static void forget(Index *s, int slot) {
    held_t *e = &s->held[slot];
    uint64_t bit = 1ULL << slot;
    for (Py_ssize_t i = 0; i < e->len; i++) clear(s, e->log[i], bit);
    PyMem_RawFree(e->log);
    Py_CLEAR(e->engine);
    memset(e, 0, sizeof(*e));
}

static PyObject *I_drop(Index *s, PyObject *engine) {
    int slot = slot_of(s, engine);
    if (slot == -2) return NULL;
    if (slot >= 0) {
        forget(s, slot);
        if (PyDict_DelItem(s->slot_of, engine)) return NULL;
    }
    Py_RETURN_NONE;
}

/* _reset(engine, hashes, limit): a (re)registered engine, in the lowest free slot; OverflowError if none. */
static PyObject *I_reset(Index *s, PyObject *const *a, Py_ssize_t n) {
    if (n != 3) { PyErr_SetString(PyExc_TypeError, "_reset(engine, hashes, limit)"); return NULL; }
    Py_ssize_t limit = PyLong_AsSsize_t(a[2]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    if (limit < 0) { PyErr_SetString(PyExc_ValueError, "_reset: a negative limit"); return NULL; }
    PyObject *r = I_drop(s, a[0]);
    if (!r) return NULL;
    Py_DECREF(r);
    int slot = 0;
    while (slot < SLOTS && s->held[slot].engine) slot++;
    if (slot == SLOTS) { PyErr_SetString(PyExc_OverflowError, "more than 64 engines"); return NULL; }
    PyObject *o = PyLong_FromLong(slot);
    if (!o || PyDict_SetItem(s->slot_of, a[0], o)) { Py_XDECREF(o); return NULL; }
    Py_DECREF(o);
    Py_INCREF(a[0]);
    s->held[slot].engine = a[0];
    s->held[slot].limit = limit;
    PyObject *none = PyTuple_New(0);
    if (!none) return NULL;
    int failed = apply(s, slot, a[1], none);
    Py_DECREF(none);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

static PyObject *I_update(Index *s, PyObject *const *a, Py_ssize_t n) {
    if (n != 3) { PyErr_SetString(PyExc_TypeError, "update(engine, stored, evicted)"); return NULL; }
    int slot = slot_of(s, a[0]);
    if (slot == -2 || (slot >= 0 && apply(s, slot, a[1], a[2]))) return NULL;
    Py_RETURN_NONE;
}

static PyObject *I_bit(Index *s, PyObject *engine) {
    int slot = slot_of(s, engine);
    if (slot == -2) return NULL;
    return PyLong_FromUnsignedLongLong(slot >= 0 ? 1ULL << slot : 0);
}

static PyObject *I_mask(Index *s, PyObject *o) {
    uint64_t h;
    if (key_of(o, &h)) return NULL;
    return PyLong_FromUnsignedLongLong(get(s, h));
}

static PyObject *I_engines_in(Index *s, PyObject *o) {
    uint64_t mask = PyLong_AsUnsignedLongLongMask(o);
    if (mask == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    PyObject *out = PyList_New(0);
    for (; out && mask; mask &= mask - 1) {
        PyObject *engine = s->held[__builtin_ctzll(mask)].engine;
        if (engine && PyList_Append(out, engine)) Py_CLEAR(out);
    }
    return out;
}

/* The binary search of PrefixIndex.longest over a sequence's items: (blocks, mask of the engines holding them). */
static int search(Index *s, PyObject *const *hs, Py_ssize_t len, uint64_t mask, Py_ssize_t *held, uint64_t *at) {
    uint64_t h;
    *held = 0; *at = 0;
    if (!len || !mask) return 0;
    if (len > 1) prefetch(s, hs, len >> 1);
    if (key_of(hs[0], &h)) return -1;
    uint64_t found = get(s, h) & mask;
    if (!found) return 0;
    Py_ssize_t lo = 0, hi = len;
    while (hi - lo > 1) {
        Py_ssize_t mid = (lo + hi) >> 1;
        if (mid - lo > 1) prefetch(s, hs, (lo + mid) >> 1);
        if (hi - mid > 1) prefetch(s, hs, (mid + hi) >> 1);
        if (key_of(hs[mid], &h)) return -1;
        uint64_t f = get(s, h) & found;
        if (f) { lo = mid; found = f; } else hi = mid;
    }
    *held = lo + 1; *at = found;
    return 0;
}

static PyObject *I_longest(Index *s, PyObject *const *a, Py_ssize_t n) {
    if (n != 2) { PyErr_SetString(PyExc_TypeError, "longest(hashes, mask)"); return NULL; }
    uint64_t mask = PyLong_AsUnsignedLongLongMask(a[1]), at;
    if (mask == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    PyObject *seq = PySequence_Fast(a[0], "hashes: a sequence");
    if (!seq) return NULL;
    Py_ssize_t held;
    int failed = search(s, PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq), mask, &held, &at);
    Py_DECREF(seq);
    if (failed) return NULL;
    return Py_BuildValue("(nK)", held, (unsigned long long)at);
}

/* A worker's free credits (its own property) and running batches: -1 on an error. */
static int load_of(PyObject *w, long *free, Py_ssize_t *running) {
    PyObject *o = PyObject_GetAttr(w, s_free_credits);
    if (!o) return -1;
    *free = PyLong_AsLong(o);
    Py_DECREF(o);
    if (*free == -1 && PyErr_Occurred()) return -1;
    if (!(o = PyObject_GetAttr(w, s_in_flight))) return -1;
    *running = PyObject_Length(o);
    Py_DECREF(o);
    return *running < 0 ? -1 : 0;
}

static PyObject *decision(PyObject *engine, PyObject *reason, Py_ssize_t matched) {
    return Py_BuildValue("(OOn)", engine, reason, matched);
}

#define CANDIDATES (2 * SLOTS)

/* How many leading blocks two chains that share their first block have in common (routing._common). */
static int common(PyObject *const *a, Py_ssize_t na, PyObject *const *b, Py_ssize_t nb, Py_ssize_t *out) {
    uint64_t x, y;
    Py_ssize_t hi = na < nb ? na : nb, lo = 1;
    *out = 0;
    if (!hi) return 0;
    if (key_of(a[hi - 1], &x) || key_of(b[hi - 1], &y)) return -1;
    if (x == y) { *out = hi; return 0; }
    while (hi - lo > 1) {  /* a[lo - 1] == b[lo - 1], a[hi - 1] != b[hi - 1] */
        Py_ssize_t mid = (lo + hi) >> 1;
        if (key_of(a[mid - 1], &x) || key_of(b[mid - 1], &y)) return -1;
        if (x == y) lo = mid; else hi = mid;
    }
    *out = lo;
    return 0;
}

/* The most leading blocks the hashes have in common with one of the last MAX_COMPARED prompts of a list
   (routing._longest_common); -1 on an error. */
static Py_ssize_t longest_common(PyObject *const *hs, Py_ssize_t len, PyObject *prompts, Py_ssize_t compared) {
    Py_ssize_t best = 0, n = PyList_GET_SIZE(prompts), c;
    for (Py_ssize_t i = n > compared ? n - compared : 0; i < n; i++) {
        PyObject *p = PyList_GET_ITEM(prompts, i);
        if (!PyList_Check(p) && !PyTuple_Check(p)) {
            PyErr_SetString(PyExc_TypeError, "a prompt in flight: a list of hashes");
            return -1;
        }
        if (common(hs, len, PySequence_Fast_ITEMS(p), PySequence_Fast_GET_SIZE(p), &c)) return -1;
        if (c > best && (best = c) == len) break;
    }
    return best;
}

/* *out: the most leading blocks an engine computes of the hashes (flying[engine]'s prompts), -1 if none. */
static int computes(PyObject *flying, PyObject *engine, PyObject *const *hs, Py_ssize_t len, Py_ssize_t compared,
                    Py_ssize_t *out) {
    *out = -1;
    PyObject *prompts = flying ? PyDict_GetItemWithError(flying, engine) : NULL;
    if (!prompts) return PyErr_Occurred() ? -1 : 0;
    if (!PyList_Check(prompts)) { PyErr_SetString(PyExc_TypeError, "in flight: a list of prompts"); return -1; }
    if (PyList_GET_SIZE(prompts) && (*out = longest_common(hs, len, prompts, compared)) < 0) return -1;
    return 0;
}

/* route(hashes, least, workers, spill_ratio, spill_slack, flying, compared): PrefixRouter.route's decision, the
   same as PrefixRouter._choose's: the candidates are ``least``, the engines with credit holding the first block
   (by slot), and those with credit computing it without holding it (``flying``: None, or engine -> the prompts
   in flight there under the first block, InFlightPrompts.at; in its order); each scores the leading blocks it
   holds (one joint search) or computes (the last ``compared`` prompts in flight there), whichever is more.
   None where there are more candidates than it keeps (the caller's Python path decides then).
   A worker's load is read through Python (free_credits is a property), which may change anything meanwhile:
   the engines and workers read are held, and the table, the slots, the prompts in flight and the hashes' items
   are read after all of it. */
static PyObject *I_route(Index *s, PyObject *const *a, Py_ssize_t n) {
    if (n != 7) {
        PyErr_SetString(PyExc_TypeError, "route(hashes, least, workers, ratio, slack, flying, compared)");
        return NULL;
    }
    PyObject *workers = a[2], *flying = a[5] == Py_None ? NULL : a[5];
    PyObject *result = NULL, *least_id = NULL, *seq = NULL, *keys = NULL;
    PyObject *engine[CANDIDATES];  /* the candidates after the least loaded, held */
    int k = 0;
    if (!PyDict_Check(workers) || (flying && !PyDict_Check(flying))) {
        PyErr_SetString(PyExc_TypeError, "route: workers and flying must be dicts");
        return NULL;
    }
    double ratio = PyFloat_AsDouble(a[3]), slack = PyFloat_AsDouble(a[4]);
    Py_ssize_t compared = PyLong_AsSsize_t(a[6]);
    if (PyErr_Occurred()) return NULL;
    if (!(least_id = PyObject_GetAttr(a[1], s_worker_id))) return NULL;
    if (!(seq = PySequence_Fast(a[0], "hashes: a sequence"))) goto done;
    uint64_t h, mask, at;
    Py_ssize_t held, matched;
    if (!PySequence_Fast_GET_SIZE(seq)) { result = decision(least_id, s_least, 0); goto done; }
    if (key_of(PySequence_Fast_GET_ITEM(seq, 0), &h)) goto done;
    if (flying && !PyDict_GET_SIZE(flying)) flying = NULL;
    if (!(mask = get(s, h)) && !flying) { result = decision(least_id, s_least, 0); goto done; }
    long free;
    Py_ssize_t least_running, running;
    PyObject *o = PyObject_GetAttr(a[1], s_in_flight);
    if (!o) goto done;
    least_running = PyObject_Length(o);
    Py_DECREF(o);
    if (least_running < 0) goto done;
    int least_slot = slot_of(s, least_id);
    if (least_slot == -2) goto done;
    uint64_t least_bit = least_slot >= 0 ? 1ULL << least_slot : 0;
    Py_ssize_t load[CANDIDATES];
    uint64_t bits[CANDIDATES];
    /* the candidates after the least loaded: the first block's holders with credit, by slot, then the engines
       with credit computing it that do not hold it (their bit scores nothing), in flying's order */
    if (flying && PyDict_GET_SIZE(flying) > CANDIDATES - SLOTS) { Py_INCREF(Py_None); result = Py_None; goto done; }
    if (flying && !(keys = PyDict_Keys(flying))) goto done;  /* held: Python code below may change flying */
    Py_ssize_t holders = -1, nkeys = keys ? PyList_GET_SIZE(keys) : 0;
    for (uint64_t rest = mask & ~least_bit; holders < nkeys; ) {
        PyObject *e, *w;
        int slot = -1;
        if (rest) {
            slot = __builtin_ctzll(rest);
            rest &= rest - 1;
            if (!(e = s->held[slot].engine)) continue;  /* gone meanwhile (Python code ran) */
        } else {
            if (++holders == nkeys) break;
            e = PyList_GET_ITEM(keys, holders);
            int r = PyObject_RichCompareBool(e, least_id, Py_EQ);
            if (r < 0) goto done;
            if (r) continue;
            int its = slot_of(s, e);
            if (its == -2) goto done;
            if (its >= 0 && (mask >> its & 1)) continue;  /* a holder: scored above, or without credit */
        }
        Py_INCREF(e);
        if (!(w = PyDict_GetItemWithError(workers, e))) {
            Py_DECREF(e);
            if (PyErr_Occurred()) goto done;
            continue;
        }
        Py_INCREF(w);
        int failed = load_of(w, &free, &running);
        Py_DECREF(w);
        if (failed || free <= 0) { Py_DECREF(e); if (failed) goto done; continue; }
        engine[k] = e; load[k] = running; bits[k] = slot >= 0 ? 1ULL << slot : 0; k++;
    }
    /* read again, after the Python code above: the slots and the sequence's items as they are now */
    if ((least_slot = slot_of(s, least_id)) == -2) goto done;
    least_bit = least_slot >= 0 ? 1ULL << least_slot : 0;
    uint64_t scored = least_bit;
    for (int i = 0; i < k; i++) {
        if (bits[i] && s->held[__builtin_ctzll(bits[i])].engine != engine[i]) bits[i] = 0;  /* changed hands */
        scored |= bits[i];
    }
    PyObject *const *hs = PySequence_Fast_ITEMS(seq);
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    if (search(s, hs, len, scored, &held, &at)) goto done;
    Py_ssize_t longest = held, computing[CANDIDATES], least_computing;  /* -1: computes none of it */
    if (computes(flying, least_id, hs, len, compared, &least_computing)) goto done;
    if (least_computing > longest) longest = least_computing;
    for (int i = 0; i < k; i++) {
        if (computes(flying, engine[i], hs, len, compared, &computing[i])) goto done;
        if (computing[i] > longest) longest = computing[i];
    }
    if (!longest) { result = decision(least_id, s_least, 0); goto done; }
    if (held < longest) at = 0;
    /* the most blocks; among those, the fewest running sequences (the first such; -1: the least loaded) */
    int best = -1, found = (at & least_bit) || least_computing == longest;
    Py_ssize_t best_running = least_running;
    for (int i = 0; i < k; i++) {
        if (!((bits[i] & at) || computing[i] == longest)) continue;
        if (!found || load[i] < best_running) { best = i; best_running = load[i]; found = 1; }
    }
    if (best < 0) { result = decision(least_id, s_match, longest); goto done; }
    if ((double)best_running > ratio * (double)least_running + slack) {
        if (search(s, hs, len, least_bit, &matched, &at)) goto done;
        result = decision(least_id, s_spill, matched > least_computing ? matched : least_computing);  /* -1 < 0 */
        goto done;
    }
    result = decision(engine[best], s_match, longest);
done:
    for (int i = 0; i < k; i++) Py_DECREF(engine[i]);
    Py_XDECREF(keys); Py_XDECREF(seq); Py_DECREF(least_id);
    return result;
}

/* export(): per slot, None or (engine, limit, the hashes it holds, each once, in its log's order), as
   PrefixIndex.export; what PrefixIndex.restore takes. A hash's bit is cleared once listed (so a second copy in
   the log is passed over), then set again. */
static PyObject *held_hashes(Index *s, held_t *e, uint64_t bit) {
    PyObject *hashes = PyList_New(0);
    if (!hashes) return NULL;
    int failed = 0;
    for (Py_ssize_t i = 0; !failed && i < e->len; i++) {
        uint64_t *p = find(s, e->log[i]);
        if (!p || !(*p & bit)) continue;
        PyObject *h = PyLong_FromUnsignedLongLong(e->log[i]);
        failed = !h || PyList_Append(hashes, h);
        Py_XDECREF(h);
        if (!failed) *p ^= bit;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(hashes); i++)
        *find(s, PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(hashes, i))) |= bit;
    if (failed) Py_CLEAR(hashes);
    return hashes;
}

static PyObject *I_export(Index *s, PyObject *unused) {
    PyObject *out = PyList_New(SLOTS);
    if (!out) return NULL;
    for (int slot = 0; slot < SLOTS; slot++) {
        held_t *e = &s->held[slot];
        PyObject *item = Py_None, *hashes;
        if (!e->engine) Py_INCREF(Py_None);
        else if (!(hashes = held_hashes(s, e, 1ULL << slot))
                 || !(item = Py_BuildValue("(OnN)", e->engine, e->limit, hashes))) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, slot, item);
    }
    return out;
}

static PyObject *I_log_size(Index *s, PyObject *engine) {
    int slot = slot_of(s, engine);
    if (slot == -2) return NULL;
    return PyLong_FromSsize_t(slot >= 0 ? s->held[slot].len : 0);
}

static PyObject *I_longest_run(Index *s, PyObject *unused) {
    uint64_t most = 0, run = 0;
    for (uint64_t i = 0; i < 2 * s->cap; i++) {  /* twice round: a run may wrap past the end */
        if (s->t[i & (s->cap - 1)].key != EMPTY) { if (++run > most) most = run; } else run = 0;
        if (run >= s->cap) break;
    }
    return PyLong_FromUnsignedLongLong(most);
}

static PyObject *I_table_bytes(Index *s, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(s->cap * sizeof(entry_t));
}

static Py_ssize_t I_len(Index *s) {
    Py_ssize_t n = 0;
    for (int slot = 0; slot < SLOTS; slot++) n += s->held[slot].count;
    return n;
}

/* Index(seed): seed keys the home slots (a random one from the wrapper). */
static PyObject *I_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    PyObject *seed;
    if (!PyArg_ParseTuple(args, "O:Index", &seed)) return NULL;
    uint64_t key = PyLong_AsUnsignedLongLongMask(seed);
    if (key == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    Index *s = (Index *)type->tp_alloc(type, 0);
    if (!s) return NULL;
    s->seed = key;
    s->slot_of = PyDict_New();
    if (!s->slot_of || resize(s, 1024)) { Py_DECREF(s); return NULL; }
    return (PyObject *)s;
}

static void I_dealloc(Index *s) {
    PyObject_GC_UnTrack(s);
    for (int slot = 0; slot < SLOTS; slot++) { PyMem_RawFree(s->held[slot].log); Py_CLEAR(s->held[slot].engine); }
    PyMem_RawFree(s->t);
    Py_CLEAR(s->slot_of);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static int I_traverse(Index *s, visitproc visit, void *arg) {
    Py_VISIT(s->slot_of);
    for (int slot = 0; slot < SLOTS; slot++) Py_VISIT(s->held[slot].engine);
    return 0;
}

static int I_clear(Index *s) {
    Py_CLEAR(s->slot_of);
    for (int slot = 0; slot < SLOTS; slot++) Py_CLEAR(s->held[slot].engine);
    return 0;
}

#define FAST(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL
static PyMethodDef I_methods[] = {
    {"_reset", FAST(I_reset), "_reset(engine, hashes, limit)"},
    {"update", FAST(I_update), "Apply an engine's deltas (an unknown engine's are ignored)."},
    {"drop", (PyCFunction)I_drop, METH_O, "The engine is gone: its entries go now."},
    {"bit", (PyCFunction)I_bit, METH_O, "The engine's bit in the masks (0 if it is not indexed)."},
    {"mask", (PyCFunction)I_mask, METH_O, "The mask of the engines holding block h."},
    {"engines_in", (PyCFunction)I_engines_in, METH_O, "The engines whose bits are set in mask, by slot."},
    {"longest", FAST(I_longest), "The most leading blocks one engine of mask holds, and the mask of those."},
    {"route", FAST(I_route), "route(hashes, least, workers, spill_ratio, spill_slack, flying, compared)"},
    {"export", (PyCFunction)I_export, METH_NOARGS, "Per slot: None or (engine, limit, hashes held)."},
    {"log_size", (PyCFunction)I_log_size, METH_O, "The length of the engine's log."},
    {"table_bytes", (PyCFunction)I_table_bytes, METH_NOARGS, "The table's bytes."},
    {"longest_run", (PyCFunction)I_longest_run, METH_NOARGS, "The most slots a probe may scan (a run of full ones)."},
    {NULL}};
static PySequenceMethods I_sequence = {.sq_length = (lenfunc)I_len};
static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_zserve_prefix_table.Index",
    .tp_basicsize = sizeof(Index),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = I_new, .tp_dealloc = (destructor)I_dealloc, .tp_traverse = (traverseproc)I_traverse,
    .tp_clear = (inquiry)I_clear, .tp_methods = I_methods, .tp_as_sequence = &I_sequence};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_zserve_prefix_table", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__zserve_prefix_table(void) {
    if (PyType_Ready(&IndexType) < 0) return NULL;
    s_worker_id = PyUnicode_InternFromString("worker_id");
    s_free_credits = PyUnicode_InternFromString("free_credits");
    s_in_flight = PyUnicode_InternFromString("in_flight");
    s_match = PyUnicode_InternFromString("match");
    s_spill = PyUnicode_InternFromString("spill");
    s_least = PyUnicode_InternFromString("least_loaded");
    if (!s_worker_id || !s_free_credits || !s_in_flight || !s_match || !s_spill || !s_least) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&IndexType);
    if (PyModule_AddObject(m, "Index", (PyObject *)&IndexType) < 0) {
        Py_DECREF(&IndexType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
"""
