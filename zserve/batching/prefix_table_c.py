"""The C source of ``zserve.batching.prefix_table``'s index (a CPython extension module, built on first use).

What it keeps is ``zserve.batching.prefix_index.PrefixIndex``'s, for at most 64 engines (a mask is one uint64):
block hash -> mask of the engines' slots holding it, in one flat open-addressing table of (hash, mask) pairs
(16 bytes a slot, linear probing from a home keyed by a random seed, backward-shift deletion so no tombstones build
up; hash 0 is kept apart, 0 marks an empty slot), and per engine its slot, count, bound and log (the hashes it
stored, oldest first, as uint64: no Python int per entry). One probe reads one cache line, where a dict's reads
three (its index, its entry, the key int), and a step's deltas or a request's choice is one call.

It keeps the router's prompts in flight too (``routing.InFlightPrompts``'s contents, for engines with a slot):
each prompt's hashes copied as uint64s, in a list per first block and slot, newest first, in pools indexed by
int32 (item id -> its flight, first block -> its group: two more maps of the same kind). So a route compares
a request with them without reading a cold Python int, and a dispatch (the choice, then the sequence in flight)
or a batch's finish is one call: with 64 sequences in flight this took the router's calls from ~6 to ~4.5 us.

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

typedef struct { uint64_t key, mask; } entry_t;  /* mask: the key's value (0: none) */
/* A map of uint64 -> uint64 (0: no value): open addressing, linear probing from a home keyed by the index's seed,
   backward-shift deletion (no tombstones), kept under half full; key 0 (an empty slot's) is kept apart. */
typedef struct {
    entry_t *t;
    uint64_t cap, used;  /* cap: a power of two; used: keys present */
    int shift;           /* 64 - log2(cap) */
    uint64_t zero;       /* key 0's value */
} map_t;
/* the routing counters kept per engine (PrefixRouter's EngineCounters): prompt blocks routed, found, and the
   decisions by reason */
enum { REQUESTED, FOUND, MATCHES, SPILLS, LEAST, COUNTERS };
typedef struct {
    PyObject *engine;  /* NULL: a free slot */
    uint64_t *log;
    Py_ssize_t len, cap, count, limit;
    uint64_t counted[COUNTERS];  /* since it took this slot: the dispatches that chose it */
} held_t;
/* A prompt in flight (routing.InFlightPrompts'): routed to the engine in ``slot``, not finished; its hashes copied
   (no Python int to read), in its group's list for that slot. Free: h NULL, ``older`` links the free list. */
typedef struct {
    uint64_t item, *h;
    Py_ssize_t n;
    int32_t group, slot, older, newer;
} flight_t;
/* The prompts in flight under one first block: per slot the newest (-1: none), each linking to the one routed
   there before it; mask: the slots with some. Free: mask 0, newest[0] links the free list. */
typedef struct {
    uint64_t first, mask;
    int32_t newest[SLOTS];
} group_t;
typedef struct {
    PyObject_HEAD
    map_t table;         /* block hash -> the mask of the engines' slots holding it */
    uint64_t seed;       /* keys the home slots (see home) */
    PyObject *slot_of;   /* engine -> its slot (a Python int) */
    held_t held[SLOTS];
    map_t items, groups; /* item id -> its flight + 1; first block -> its group + 1 */
    flight_t *fl;
    group_t *gr;
    int32_t fl_cap, fl_free, fl_count, gr_cap, gr_free;
} Index;

static PyObject *s_worker_id, *s_free_credits, *s_in_flight, *s_match, *s_spill, *s_least;

/* A key's home slot: the top bits of MurmurHash3's finaliser of the key keyed by this index's random seed. Block
   hashes are public (anyone can compute a prompt's), so an unkeyed home (the top bits of h * 2^64/phi, as before)
   let a client grind prompts whose blocks share one home: one probe run of thousands of slots that every lookup
   landing in it scans (83 us a route, was 2.5). */
static inline uint64_t home(uint64_t seed, const map_t *m, uint64_t h) {
    h ^= seed;
    h ^= h >> 33; h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33; h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h >> m->shift;
}

/* A pointer to h's value, or NULL where h has none (key 0's: always, 0 if none). */
static inline uint64_t *mfind(map_t *m, uint64_t seed, uint64_t h) {
    if (h == EMPTY) return &m->zero;
    uint64_t k = m->cap - 1, j = home(seed, m, h);
    for (;;) {
        entry_t *e = &m->t[j];
        if (e->key == h) return &e->mask;
        if (e->key == EMPTY) return NULL;
        j = (j + 1) & k;
    }
}

static int mresize(map_t *m, uint64_t seed, uint64_t cap) {
    entry_t *old = m->t, *t = PyMem_RawCalloc(cap, sizeof(entry_t));
    uint64_t oc = m->cap;
    if (!t) { PyErr_NoMemory(); return -1; }
    m->t = t; m->cap = cap; m->shift = 64 - __builtin_ctzll(cap);
    for (uint64_t i = 0; i < oc; i++) if (old[i].key != EMPTY) {
        uint64_t j = home(seed, m, old[i].key);
        while (t[j].key != EMPTY) j = (j + 1) & (cap - 1);
        t[j] = old[i];
    }
    PyMem_RawFree(old);
    return 0;
}

/* Room for one more key (the map stays under half full), so the next minsert cannot fail. */
static inline int mreserve(map_t *m, uint64_t seed) {
    return (m->used + 1) * 2 > m->cap ? mresize(m, seed, m->cap * 2) : 0;
}

/* h's value, made (0) if it had none; NULL on no memory. */
static uint64_t *minsert(map_t *m, uint64_t seed, uint64_t h) {
    if (h == EMPTY) return &m->zero;
    uint64_t *p = mfind(m, seed, h);
    if (p) return p;
    if (mreserve(m, seed)) return NULL;
    uint64_t k = m->cap - 1, j = home(seed, m, h);
    while (m->t[j].key != EMPTY) j = (j + 1) & k;
    m->t[j].key = h; m->t[j].mask = 0; m->used++;
    return &m->t[j].mask;
}

/* h's entry goes (it must have one); the entries after it in its run move back where their probe allows. */
static void merase(map_t *m, uint64_t seed, uint64_t h) {
    if (h == EMPTY) { m->zero = 0; return; }
    uint64_t k = m->cap - 1, i = home(seed, m, h);
    while (m->t[i].key != h) i = (i + 1) & k;
    for (uint64_t j = i;;) {
        j = (j + 1) & k;
        if (m->t[j].key == EMPTY) break;
        uint64_t o = home(seed, m, m->t[j].key);
        if (i <= j ? (i < o && o <= j) : (i < o || o <= j)) continue;  /* its home is after the hole: it stays */
        m->t[i] = m->t[j]; i = j;
    }
    m->t[i].key = EMPTY; m->t[i].mask = 0; m->used--;
}

/* The block table's: a hash's mask of holders. */
static inline uint64_t *find(Index *s, uint64_t h) { return mfind(&s->table, s->seed, h); }
static inline uint64_t get(Index *s, uint64_t h) { uint64_t *p = find(s, h); return p ? *p : 0; }
static inline uint64_t *insert(Index *s, uint64_t h) { return minsert(&s->table, s->seed, h); }
static inline void erase(Index *s, uint64_t h) { merase(&s->table, s->seed, h); }

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
static inline void prefetch(Index *s, uint64_t h) { __builtin_prefetch(&s->table.t[home(s->seed, &s->table, h)]); }
static inline void prefetch_item(Index *s, PyObject *const *hs, Py_ssize_t i) {
    if (PyLong_CheckExact(hs[i])) prefetch(s, PyLong_AsUnsignedLongLongMask(hs[i]));
}

static int apply(Index *s, int slot, PyObject *stored, PyObject *evicted) {
    held_t *e = &s->held[slot];
    uint64_t bit = 1ULL << slot, h;
    PyObject *ev = PySequence_Fast(evicted, "evicted: hashes"), *st = NULL;
    if (!ev) return -1;
    if (!(st = PySequence_Fast(stored, "stored: hashes"))) goto fail;
    /* every hash's line asked for at once: their misses overlap, where probing them in turn waits for each */
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(ev); i++) prefetch_item(s, PySequence_Fast_ITEMS(ev), i);
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(st); i++) prefetch_item(s, PySequence_Fast_ITEMS(st), i);
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

/* ---- the prompts in flight (routing.InFlightPrompts, kept here so a route reads no Python object for them) ---- */

static int32_t flight_of(Index *s, uint64_t item) {  /* -1: not in flight */
    uint64_t *p = mfind(&s->items, s->seed, item);
    return p && *p ? (int32_t)(*p - 1) : -1;
}

/* A free flight and a free group in the pools (grown as needed), so a fly cannot fail once they are there. */
static int grow_pools(Index *s) {
    if (s->fl_free < 0) {
        int32_t old = s->fl_cap, cap = old ? old * 2 : 64;
        flight_t *fl = old < (1 << 29) ? PyMem_RawRealloc(s->fl, cap * sizeof(flight_t)) : NULL;
        if (!fl) { PyErr_NoMemory(); return -1; }
        for (int32_t i = old; i < cap; i++) { fl[i].h = NULL; fl[i].older = i + 1 < cap ? i + 1 : -1; }
        s->fl = fl; s->fl_cap = cap; s->fl_free = old;
    }
    if (s->gr_free < 0) {
        int32_t old = s->gr_cap, cap = old ? old * 2 : 16;
        group_t *gr = old < (1 << 22) ? PyMem_RawRealloc(s->gr, cap * sizeof(group_t)) : NULL;
        if (!gr) { PyErr_NoMemory(); return -1; }
        for (int32_t i = old; i < cap; i++) { gr[i].mask = 0; gr[i].newest[0] = i + 1 < cap ? i + 1 : -1; }
        s->gr = gr; s->gr_cap = cap; s->gr_free = old;
    }
    return 0;
}

/* Flight f is over (finished, routed again, or its engine gone). */
static void land(Index *s, int32_t f) {
    flight_t *r = &s->fl[f];
    group_t *g = &s->gr[r->group];
    merase(&s->items, s->seed, r->item);
    if (r->newer >= 0) s->fl[r->newer].older = r->older; else g->newest[r->slot] = r->older;
    if (r->older >= 0) s->fl[r->older].newer = r->newer;
    if (g->newest[r->slot] < 0 && !(g->mask &= ~(1ULL << r->slot))) {
        merase(&s->groups, s->seed, g->first);
        g->newest[0] = s->gr_free; s->gr_free = r->group;
    }
    PyMem_RawFree(r->h);
    r->h = NULL; r->older = s->fl_free; s->fl_free = f;
    s->fl_count--;
}

static void land_slot(Index *s, int slot) {
    for (int32_t f = 0; f < s->fl_cap; f++) if (s->fl[f].h && s->fl[f].slot == slot) land(s, f);
}

/* Item ``item`` was routed to the engine in ``slot`` with these n (>= 1) hashes (InFlightPrompts.add). */
static int fly(Index *s, uint64_t item, int slot, const uint64_t *hs, Py_ssize_t n) {
    int32_t f = flight_of(s, item);
    if (f >= 0) land(s, f);  /* routed again (re-dispatched after its engine was lost) */
    uint64_t *copy = PyMem_RawMalloc(n * sizeof(uint64_t));
    if (!copy) { PyErr_NoMemory(); return -1; }
    if (grow_pools(s) || mreserve(&s->items, s->seed) || mreserve(&s->groups, s->seed)) {
        PyMem_RawFree(copy);
        return -1;
    }
    memcpy(copy, hs, n * sizeof(uint64_t));
    uint64_t *gp = minsert(&s->groups, s->seed, hs[0]);  /* reserved: cannot fail */
    int32_t g = (int32_t)*gp - 1;
    if (g < 0) {
        g = s->gr_free; s->gr_free = s->gr[g].newest[0];
        s->gr[g].first = hs[0]; s->gr[g].mask = 0;
        for (int i = 0; i < SLOTS; i++) s->gr[g].newest[i] = -1;
        *gp = (uint64_t)g + 1;
    }
    f = s->fl_free;
    flight_t *r = &s->fl[f];
    s->fl_free = r->older;
    r->item = item; r->h = copy; r->n = n; r->group = g; r->slot = slot; r->newer = -1;
    r->older = s->gr[g].newest[slot];
    if (r->older >= 0) s->fl[r->older].newer = f;
    s->gr[g].newest[slot] = f;
    s->gr[g].mask |= 1ULL << slot;
    *minsert(&s->items, s->seed, item) = (uint64_t)f + 1;
    s->fl_count++;
    return 0;
}

static int32_t group_of(Index *s, uint64_t first) {  /* -1: nothing in flight under it */
    uint64_t *p = mfind(&s->groups, s->seed, first);
    return p && *p ? (int32_t)(*p - 1) : -1;
}

/* How many leading blocks two chains that share their first block have in common (routing._common). */
static Py_ssize_t common(const uint64_t *a, Py_ssize_t na, const uint64_t *b, Py_ssize_t nb) {
    Py_ssize_t hi = na < nb ? na : nb, lo = 1;
    if (!hi) return 0;
    if (a[hi - 1] == b[hi - 1]) return hi;
    while (hi - lo > 1) {  /* a[lo - 1] == b[lo - 1], a[hi - 1] != b[hi - 1] */
        Py_ssize_t mid = (lo + hi) >> 1;
        if (a[mid - 1] == b[mid - 1]) lo = mid; else hi = mid;
    }
    return lo;
}

/* The most leading blocks of hs the engine in ``slot`` computes: the most any of its newest ``compared`` prompts
   in flight under hs[0] (group g) has in common with them (routing._longest_common); -1 if it computes none. */
static Py_ssize_t computes(Index *s, int32_t g, int slot, const uint64_t *hs, Py_ssize_t len, Py_ssize_t compared) {
    int32_t f = g >= 0 && slot >= 0 ? s->gr[g].newest[slot] : -1;
    if (f < 0) return -1;
    Py_ssize_t best = 0;
    for (; f >= 0 && compared-- > 0; f = s->fl[f].older) {
        Py_ssize_t c = common(hs, len, s->fl[f].h, s->fl[f].n);
        if (c > best && (best = c) == len) break;
    }
    return best;
}

/* ---- engines ---- */

static void forget_entries(Index *s, int slot) {
    held_t *e = &s->held[slot];
    uint64_t bit = 1ULL << slot;
    for (Py_ssize_t i = 0; i < e->len; i++) clear(s, e->log[i], bit);
    PyMem_RawFree(e->log);
    e->log = NULL; e->len = e->cap = e->count = 0;
}

static PyObject *I_drop(Index *s, PyObject *engine) {
    int slot = slot_of(s, engine);
    if (slot == -2) return NULL;
    if (slot >= 0) {
        forget_entries(s, slot);
        land_slot(s, slot);
        Py_CLEAR(s->held[slot].engine);
        memset(s->held[slot].counted, 0, sizeof(s->held[slot].counted));
        if (PyDict_DelItem(s->slot_of, engine)) return NULL;
    }
    Py_RETURN_NONE;
}

/* _reset(engine, hashes, limit): a registered engine's snapshot. A new one takes the lowest free slot
   (OverflowError if none); one registered again keeps its slot and its prompts in flight, its entries replaced. */
static PyObject *I_reset(Index *s, PyObject *const *a, Py_ssize_t n) {
    if (n != 3) { PyErr_SetString(PyExc_TypeError, "_reset(engine, hashes, limit)"); return NULL; }
    Py_ssize_t limit = PyLong_AsSsize_t(a[2]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    if (limit < 0) { PyErr_SetString(PyExc_ValueError, "_reset: a negative limit"); return NULL; }
    int slot = slot_of(s, a[0]);
    if (slot == -2) return NULL;
    if (slot >= 0) forget_entries(s, slot);
    else {
        slot = 0;
        while (slot < SLOTS && s->held[slot].engine) slot++;
        if (slot == SLOTS) { PyErr_SetString(PyExc_OverflowError, "more than 64 engines"); return NULL; }
        PyObject *o = PyLong_FromLong(slot);
        if (!o || PyDict_SetItem(s->slot_of, a[0], o)) { Py_XDECREF(o); return NULL; }
        Py_DECREF(o);
        Py_INCREF(a[0]);
        s->held[slot].engine = a[0];
    }
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

/* A request's hashes as uint64s: in ``buf`` (a prompt of up to routing.MAX_ROUTE_BLOCKS blocks), else allocated. */
#define ROUTE_BUF 256
typedef struct { uint64_t *h, buf[ROUTE_BUF]; Py_ssize_t n; } hashes_t;

/* From a sequence of ints, or bytes packed as little-endian uint64s (prefix_hash.pack: a partial last one is
   dropped), read as they are. */
static int read_hashes(PyObject *o, hashes_t *out) {
    if (PyBytes_Check(o)) {
        Py_ssize_t n = PyBytes_GET_SIZE(o) / 8;
        const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(o);
        out->n = n;
        out->h = n <= ROUTE_BUF ? out->buf : PyMem_RawMalloc(n * sizeof(uint64_t));
        if (!out->h) { PyErr_NoMemory(); return -1; }
        memcpy(out->h, p, n * sizeof(uint64_t));
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        for (Py_ssize_t i = 0; i < n; i++) out->h[i] = __builtin_bswap64(out->h[i]);
#endif
        return 0;
    }
    PyObject *seq = PySequence_Fast(o, "hashes: a sequence");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    out->n = n;
    out->h = n <= ROUTE_BUF ? out->buf : PyMem_RawMalloc(n * sizeof(uint64_t));
    if (!out->h) { Py_DECREF(seq); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (key_of(items[i], &out->h[i])) {  /* runs no Python code: the sequence cannot change meanwhile */
            if (out->h != out->buf) PyMem_RawFree(out->h);
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

static void free_hashes(hashes_t *hs) { if (hs->h != hs->buf) PyMem_RawFree(hs->h); }

/* The binary search of PrefixIndex.longest: (blocks, mask of the engines of ``mask`` holding them). */
static void search(Index *s, const uint64_t *hs, Py_ssize_t len, uint64_t mask, Py_ssize_t *held, uint64_t *at) {
    *held = 0; *at = 0;
    if (!len || !mask) return;
    if (len > 1) prefetch(s, hs[len >> 1]);
    uint64_t found = get(s, hs[0]) & mask;
    if (!found) return;
    Py_ssize_t lo = 0, hi = len;
    while (hi - lo > 1) {
        Py_ssize_t mid = (lo + hi) >> 1;
        if (mid - lo > 1) prefetch(s, hs[(lo + mid) >> 1]);
        if (hi - mid > 1) prefetch(s, hs[(mid + hi) >> 1]);
        uint64_t f = get(s, hs[mid]) & found;
        if (f) { lo = mid; found = f; } else hi = mid;
    }
    *held = lo + 1; *at = found;
}

static PyObject *I_longest(Index *s, PyObject *const *a, Py_ssize_t n) {
    if (n != 2) { PyErr_SetString(PyExc_TypeError, "longest(hashes, mask)"); return NULL; }
    uint64_t mask = PyLong_AsUnsignedLongLongMask(a[1]), at;
    if (mask == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    hashes_t hs;
    if (read_hashes(a[0], &hs)) return NULL;
    Py_ssize_t held;
    search(s, hs.h, hs.n, mask, &held, &at);
    free_hashes(&hs);
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

/* PrefixRouter.route's decision, the same as PrefixRouter._choose's, with *chosen the chosen engine's slot (-1:
   not indexed). The candidates are ``least`` and, by slot, the engines with credit that hold the first block or
   compute it (a prompt in flight there starts with it); each scores the leading blocks it holds (one joint
   search) or computes (its newest ``compared`` prompts in flight under the first block), whichever is more.
   A worker's load is read through Python (free_credits is a property), which may change anything meanwhile:
   the engines read are held, and the slots, the table and the prompts in flight are read after all of it. */
static PyObject *choose(Index *s, const uint64_t *hs, Py_ssize_t len, PyObject *least, PyObject *workers,
                        double ratio, double slack, Py_ssize_t compared, int *chosen) {
    PyObject *result = NULL, *least_id, *engine[SLOTS];  /* the candidates after the least loaded, held */
    int k = 0, slot[SLOTS];
    Py_ssize_t load[SLOTS], computing[SLOTS], least_running, held, matched;
    uint64_t at;
    *chosen = -1;
    if (!(least_id = PyObject_GetAttr(least, s_worker_id))) return NULL;
    int least_slot = slot_of(s, least_id);
    if (least_slot == -2) goto done;
    int32_t g = len ? group_of(s, hs[0]) : -1;
    uint64_t mask = len ? get(s, hs[0]) | (g >= 0 ? s->gr[g].mask : 0) : 0;
    if (!mask) { *chosen = least_slot; result = decision(least_id, s_least, 0); goto done; }
    PyObject *o = PyObject_GetAttr(least, s_in_flight);
    if (!o) goto done;
    least_running = PyObject_Length(o);
    Py_DECREF(o);
    if (least_running < 0) goto done;
    for (uint64_t rest = mask & ~(least_slot >= 0 ? 1ULL << least_slot : 0); rest; rest &= rest - 1) {
        int i = __builtin_ctzll(rest);
        PyObject *e = s->held[i].engine, *w;
        long free;
        Py_ssize_t running;
        if (!e) continue;  /* gone meanwhile (Python code ran) */
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
        engine[k] = e; load[k] = running; slot[k] = i; k++;
    }
    /* read again, after the Python code above: the slots, and the prompts in flight */
    if ((least_slot = slot_of(s, least_id)) == -2) goto done;
    uint64_t least_bit = least_slot >= 0 ? 1ULL << least_slot : 0, scored = least_bit;
    for (int i = 0; i < k; i++) {
        if (s->held[slot[i]].engine != engine[i] || slot[i] == least_slot) slot[i] = -1;  /* changed hands */
        else scored |= 1ULL << slot[i];
    }
    g = group_of(s, hs[0]);
    search(s, hs, len, scored, &held, &at);
    Py_ssize_t longest = held, least_computing = computes(s, g, least_slot, hs, len, compared);  /* -1: none */
    if (least_computing > longest) longest = least_computing;
    for (int i = 0; i < k; i++) {
        computing[i] = computes(s, g, slot[i], hs, len, compared);
        if (computing[i] > longest) longest = computing[i];
    }
    if (!longest) { *chosen = least_slot; result = decision(least_id, s_least, 0); goto done; }
    if (held < longest) at = 0;
    /* the most blocks; among those, the fewest running sequences (the first such; -1: the least loaded) */
    int best = -1, found = (at & least_bit) || least_computing == longest;
    Py_ssize_t best_running = least_running;
    for (int i = 0; i < k; i++) {
        if (!((slot[i] >= 0 && (at >> slot[i] & 1)) || computing[i] == longest)) continue;
        if (!found || load[i] < best_running) { best = i; best_running = load[i]; found = 1; }
    }
    if (best < 0) { *chosen = least_slot; result = decision(least_id, s_match, longest); goto done; }
    if ((double)best_running > ratio * (double)least_running + slack) {
        search(s, hs, len, least_bit, &matched, &at);
        *chosen = least_slot;
        result = decision(least_id, s_spill, matched > least_computing ? matched : least_computing);  /* -1 < 0 */
        goto done;
    }
    *chosen = slot[best];
    result = decision(engine[best], s_match, longest);
done:
    for (int i = 0; i < k; i++) Py_DECREF(engine[i]);
    Py_DECREF(least_id);
    return result;
}

static int route_args(PyObject *const *a, PyObject **workers, double *ratio, double *slack, Py_ssize_t *compared) {
    *workers = a[2];
    if (!PyDict_Check(*workers)) { PyErr_SetString(PyExc_TypeError, "route: workers must be a dict"); return -1; }
    *ratio = PyFloat_AsDouble(a[3]);
    *slack = PyFloat_AsDouble(a[4]);
    *compared = PyLong_AsSsize_t(a[5]);
    return PyErr_Occurred() ? -1 : 0;
}

/* route(hashes, least, workers, spill_ratio, spill_slack, compared): the decision (engine, reason, matched). */
static PyObject *I_route(Index *s, PyObject *const *a, Py_ssize_t n) {
    PyObject *workers, *result;
    double ratio, slack;
    Py_ssize_t compared;
    hashes_t hs;
    int chosen;
    if (n != 6) {
        PyErr_SetString(PyExc_TypeError, "route(hashes, least, workers, ratio, slack, compared)");
        return NULL;
    }
    if (route_args(a, &workers, &ratio, &slack, &compared) || read_hashes(a[0], &hs)) return NULL;
    result = choose(s, hs.h, hs.n, a[1], workers, ratio, slack, compared, &chosen);
    free_hashes(&hs);
    return result;
}

/* dispatch(item, hashes, least, workers, spill_ratio, spill_slack, compared): route's decision for queued item
   ``item``, which is then in flight on the chosen engine until ``land``, and counted (``counts``). Nothing of it
   is kept for an engine without a slot (the caller counts it then). */
static PyObject *I_dispatch(Index *s, PyObject *const *a, Py_ssize_t n) {
    PyObject *workers, *result;
    double ratio, slack;
    Py_ssize_t compared;
    uint64_t item;
    hashes_t hs;
    int chosen;
    if (n != 7) {
        PyErr_SetString(PyExc_TypeError, "dispatch(item, hashes, least, workers, ratio, slack, compared)");
        return NULL;
    }
    if (key_of(a[0], &item) || route_args(a + 1, &workers, &ratio, &slack, &compared) || read_hashes(a[1], &hs))
        return NULL;
    result = choose(s, hs.h, hs.n, a[2], workers, ratio, slack, compared, &chosen);
    /* the decision's tuple was made after choose's last read, and making it may run a collection (finalizers:
       Python code that may drop the chosen engine): its slot is looked up again */
    if (result && chosen >= 0 && (chosen = slot_of(s, PyTuple_GET_ITEM(result, 0))) == -2) Py_CLEAR(result);
    if (result && chosen >= 0) {
        if (hs.n && fly(s, item, chosen, hs.h, hs.n)) Py_CLEAR(result);
        else {
            uint64_t *c = s->held[chosen].counted;
            PyObject *reason = PyTuple_GET_ITEM(result, 1);
            c[REQUESTED] += hs.n;
            c[FOUND] += PyLong_AsSsize_t(PyTuple_GET_ITEM(result, 2));  /* a small int: cannot fail */
            c[reason == s_match ? MATCHES : reason == s_spill ? SPILLS : LEAST]++;
        }
    }
    free_hashes(&hs);
    return result;
}

/* fly(item, engine, hashes): InFlightPrompts.add (nothing kept for an engine not indexed, or no hashes). */
static PyObject *I_fly(Index *s, PyObject *const *a, Py_ssize_t n) {
    uint64_t item;
    hashes_t hs;
    if (n != 3) { PyErr_SetString(PyExc_TypeError, "fly(item, engine, hashes)"); return NULL; }
    int slot = slot_of(s, a[1]);
    if (slot == -2 || key_of(a[0], &item) || read_hashes(a[2], &hs)) return NULL;
    int failed = 0;
    if (slot < 0 || !hs.n) {  /* nothing kept: and nothing of the item's before either */
        int32_t f = flight_of(s, item);
        if (f >= 0) land(s, f);
    } else failed = fly(s, item, slot, hs.h, hs.n);
    free_hashes(&hs);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

/* land(items): these items are finished (unknown ones: nothing to do). */
static PyObject *I_land(Index *s, PyObject *items) {
    PyObject *seq = PySequence_Fast(items, "land: a sequence of item ids");
    if (!seq) return NULL;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        uint64_t item;
        if (key_of(PySequence_Fast_GET_ITEM(seq, i), &item)) { Py_DECREF(seq); return NULL; }
        int32_t f = flight_of(s, item);
        if (f >= 0) land(s, f);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* flying(first): the engines computing a prompt whose first block is ``first``, by slot. */
static PyObject *I_flying(Index *s, PyObject *o) {
    uint64_t h;
    if (key_of(o, &h)) return NULL;
    int32_t g = group_of(s, h);
    PyObject *out = PyList_New(0);
    for (uint64_t mask = g >= 0 ? s->gr[g].mask : 0; out && mask; mask &= mask - 1)
        if (s->held[__builtin_ctzll(mask)].engine && PyList_Append(out, s->held[__builtin_ctzll(mask)].engine))
            Py_CLEAR(out);
    return out;
}

/* computing(hashes, engine, compared): the most leading blocks the engine computes (0: none). */
static PyObject *I_computing(Index *s, PyObject *const *a, Py_ssize_t n) {
    hashes_t hs;
    if (n != 3) { PyErr_SetString(PyExc_TypeError, "computing(hashes, engine, compared)"); return NULL; }
    int slot = slot_of(s, a[1]);
    Py_ssize_t compared = PyLong_AsSsize_t(a[2]);
    if (slot == -2 || (compared == -1 && PyErr_Occurred()) || read_hashes(a[0], &hs)) return NULL;
    Py_ssize_t c = hs.n ? computes(s, group_of(s, hs.h[0]), slot, hs.h, hs.n, compared) : 0;
    free_hashes(&hs);
    return PyLong_FromSsize_t(c > 0 ? c : 0);
}

static PyObject *hash_list(const uint64_t *h, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *o = PyLong_FromUnsignedLongLong(h[i]);
        if (!o) Py_CLEAR(out); else PyList_SET_ITEM(out, i, o);
    }
    return out;
}

/* flights(): every prompt in flight as (item, engine, hashes), each engine's under a first block oldest first
   (what InFlightPrompts.add takes, in the order that rebuilds the same lists). Copied out first, with no Python
   object made meanwhile: making one may run a collection, whose finalizers may land flights under the walk. */
typedef struct { uint64_t item; PyObject *engine; Py_ssize_t at, n; } snapshot_t;

static PyObject *I_flights(Index *s, PyObject *unused) {
    Py_ssize_t total = 0, k = 0, at = 0;
    for (int32_t f = 0; f < s->fl_cap; f++) if (s->fl[f].h) total += s->fl[f].n;
    snapshot_t *snap = PyMem_RawMalloc((s->fl_count ? s->fl_count : 1) * sizeof(snapshot_t));
    uint64_t *hashes = PyMem_RawMalloc((total ? total : 1) * sizeof(uint64_t));
    if (!snap || !hashes) { PyMem_RawFree(snap); PyMem_RawFree(hashes); return PyErr_NoMemory(); }
    for (int32_t g = 0; g < s->gr_cap; g++) {
        for (uint64_t mask = s->gr[g].mask; mask; mask &= mask - 1) {
            int slot = __builtin_ctzll(mask);
            int32_t f = s->gr[g].newest[slot];
            while (s->fl[f].older >= 0) f = s->fl[f].older;
            for (; f >= 0; f = s->fl[f].newer) {
                snapshot_t *o = &snap[k++];
                o->item = s->fl[f].item; o->engine = s->held[slot].engine; o->at = at; o->n = s->fl[f].n;
                Py_XINCREF(o->engine);
                memcpy(hashes + at, s->fl[f].h, o->n * sizeof(uint64_t));
                at += o->n;
            }
        }
    }
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out && i < k; i++) {
        PyObject *h = hash_list(hashes + snap[i].at, snap[i].n), *t = NULL;
        PyObject *engine = snap[i].engine ? snap[i].engine : Py_None;
        if (!h || !(t = Py_BuildValue("(KON)", (unsigned long long)snap[i].item, engine, h)) || PyList_Append(out, t))
            Py_CLEAR(out);
        Py_XDECREF(t);
    }
    for (Py_ssize_t i = 0; i < k; i++) Py_XDECREF(snap[i].engine);
    PyMem_RawFree(snap); PyMem_RawFree(hashes);
    return out;
}

static PyObject *I_in_flight(Index *s, PyObject *unused) { return PyLong_FromLong(s->fl_count); }

/* counts(): per engine with a slot, (engine, requested, found, match, spill, least_loaded) since it took it. */
static PyObject *I_counts(Index *s, PyObject *unused) {
    PyObject *out = PyList_New(0);
    for (int slot = 0; out && slot < SLOTS; slot++) {
        held_t *e = &s->held[slot];
        if (!e->engine) continue;
        uint64_t *c = e->counted;
        PyObject *t = Py_BuildValue("(OKKKKK)", e->engine, (unsigned long long)c[REQUESTED],
                                    (unsigned long long)c[FOUND], (unsigned long long)c[MATCHES],
                                    (unsigned long long)c[SPILLS], (unsigned long long)c[LEAST]);
        if (!t || PyList_Append(out, t)) Py_CLEAR(out);
        Py_XDECREF(t);
    }
    return out;
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
    const map_t *m = &s->table;
    for (uint64_t i = 0; i < 2 * m->cap; i++) {  /* twice round: a run may wrap past the end */
        if (m->t[i & (m->cap - 1)].key != EMPTY) { if (++run > most) most = run; } else run = 0;
        if (run >= m->cap) break;
    }
    return PyLong_FromUnsignedLongLong(most);
}

static PyObject *I_table_bytes(Index *s, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(s->table.cap * sizeof(entry_t));
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
    s->fl_free = s->gr_free = -1;
    s->slot_of = PyDict_New();
    if (!s->slot_of || mresize(&s->table, key, 1024) || mresize(&s->items, key, 64) || mresize(&s->groups, key, 64)) {
        Py_DECREF(s);
        return NULL;
    }
    return (PyObject *)s;
}

static void I_dealloc(Index *s) {
    PyObject_GC_UnTrack(s);
    for (int slot = 0; slot < SLOTS; slot++) { PyMem_RawFree(s->held[slot].log); Py_CLEAR(s->held[slot].engine); }
    for (int32_t f = 0; f < s->fl_cap; f++) PyMem_RawFree(s->fl[f].h);
    PyMem_RawFree(s->fl); PyMem_RawFree(s->gr);
    PyMem_RawFree(s->table.t); PyMem_RawFree(s->items.t); PyMem_RawFree(s->groups.t);
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
    {"route", FAST(I_route), "route(hashes, least, workers, spill_ratio, spill_slack, compared)"},
    {"dispatch", FAST(I_dispatch), "dispatch(item, hashes, least, workers, spill_ratio, spill_slack, compared)"},
    {"fly", FAST(I_fly), "fly(item, engine, hashes): the item is in flight on the engine."},
    {"land", (PyCFunction)I_land, METH_O, "land(items): these items are finished."},
    {"flying", (PyCFunction)I_flying, METH_O, "The engines computing a prompt whose first block is h, by slot."},
    {"computing", FAST(I_computing), "computing(hashes, engine, compared): the leading blocks it computes."},
    {"flights", (PyCFunction)I_flights, METH_NOARGS, "Every prompt in flight: (item, engine, hashes)."},
    {"in_flight", (PyCFunction)I_in_flight, METH_NOARGS, "How many prompts are in flight."},
    {"counts", (PyCFunction)I_counts, METH_NOARGS, "Per engine: (engine, requested, found, match, spill, least)."},
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
