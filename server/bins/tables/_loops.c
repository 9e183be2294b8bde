/* The tables' hot loops, compiled (compiled.py says whether they were built): a search of
 * the sum tree for a batch of targets, the refresh of the blocks a batch of priority updates
 * touched, the same refresh for the lowest-priority remover's argmin tree (mintree.py), an age
 * order's argmin tree after a ring buffer's insert, the check of a batch of priorities, the
 * count of a sample's rows, the slots of a batch of keys, the gather of a sample's rows and the
 * scatter of a batch's priorities, and the copy of a batch's rows into columns in memory.
 *
 * The same arithmetic as sumtree.py's numpy path (which stays the reference, and the
 * fallback where this does not build): a slot's weight is priority ** exponent when
 * its LIVE flag is set, else 0; a leaf of the tree is the sum of its block's weights;
 * an inner node the sum of its two children.  numpy pays a few calls per tree level
 * for a batch (about 40 calls for a sample of 256 from 10^7 rows); here a level is one
 * pass over the batch, so the batch's cache misses on the lower levels overlap, and the
 * blocks reached are copied before their weights are computed (see Copy).  Arrays come
 * through the buffer protocol (numpy's, in memory or memory-mapped); the GIL is let go
 * during the loops.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define LIVE 1
/* Levels below this one are far apart in memory: their nodes are asked of memory ahead of
 * their reads (the levels above stay in the caches). */
#define PREFETCH_FROM 10
/* How many items of a batch ahead of the one being read a load is asked of memory: enough to
 * keep the misses overlapping, few enough that the requests fit the core's miss buffers
 * (asking for a whole batch of 256 blocks at once left most of them to be missed again, and
 * the refresh at 10^6 rows spent three quarters of its time on two loads). */
#define AHEAD 12

static inline double weight(double priority, uint8_t flags, double exponent) {
    if (!(flags & LIVE))
        return 0.0;
    if (exponent == 1.0)
        return priority;
    if (exponent == 0.5)
        return sqrt(priority);
    return pow(priority, exponent);
}

/* A power costs about 22-28 ns (glibc's pow, or numpy's): 4,096 of them for an update of 256
 * scattered blocks of 16, most of the refresh.  glibc's vector math library (libmvec) has AVX2
 * functions that take four at once: where the CPU and the C library have them (looked up once,
 * at import), the blocks' weights are computed four slots at a time, in the search as in the
 * refresh, so both see the same weights.  Not with libmvec's pow (40-60 ns for four: 256 blocks
 * of 16 at 10^6 rows 134 -> 86 us) but as exp(exponent * log(p)), half its time (6.7 -> 3.5 ns a
 * slot here) and within 1e-15 of pow for the priorities a table holds (the error grows with
 * |exponent * log(p)|: 2e-15 at p = 1e6).  Exact where pow is: p = 1 gives 1, p = 0 gives 0
 * (exp(-inf)); an exponent of 0 (1 for every p, 0 too) takes the scalar path.
 * Elsewhere, pow. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#include <dlfcn.h>
#include <immintrin.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
typedef __m256d (*vector_fn)(__m256d);
#pragma GCC diagnostic pop
static vector_fn exp4 = NULL, log4 = NULL;
static int have_vector_pow = 0;

__attribute__((target("avx2"))) static void vector_pow4(const double p[4], double exponent, double out[4]) {
    _mm256_storeu_pd(out, exp4(_mm256_mul_pd(_mm256_set1_pd(exponent), log4(_mm256_loadu_pd(p)))));
}

static void find_vector_pow(void) {
    if (!__builtin_cpu_supports("avx2"))
        return;
    void *lib = dlopen("libmvec.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL)
        return;
    exp4 = (vector_fn)dlsym(lib, "_ZGVdN4v_exp");
    log4 = (vector_fn)dlsym(lib, "_ZGVdN4v_log");
    have_vector_pow = exp4 != NULL && log4 != NULL;
}
#else
static const int have_vector_pow = 0;
static void vector_pow4(const double p[4], double exponent, double out[4]) { (void)p, (void)exponent, (void)out; }
static void find_vector_pow(void) {}
#endif

/* Check a buffer's item size and length; 0 with an exception set on a mismatch. */
static int check(Py_buffer *b, Py_ssize_t itemsize, Py_ssize_t at_least, const char *what) {
    if (b->itemsize != itemsize || b->len % itemsize != 0) {
        PyErr_Format(PyExc_TypeError, "%s: items of %zd bytes expected", what, itemsize);
        return 0;
    }
    if (b->len / itemsize < at_least) {
        PyErr_Format(PyExc_ValueError, "%s: at least %zd items expected, got %zd", what, at_least,
                     b->len / itemsize);
        return 0;
    }
    return 1;
}

/* Whether every one of ``slots`` is in [0, length); 0 with an IndexError set if not. */
static int slots_in_range(const int64_t *slots, Py_ssize_t n, Py_ssize_t length) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= length) {
            PyErr_Format(PyExc_IndexError, "slot %lld is not in [0, %zd)", (long long)slots[i], length);
            return 0;
        }
    }
    return 1;
}

/* The tree (b[0], float64, 2 << depth nodes) and the slots' state (b[1] priority,
 * float64, and b[2] flags, uint8, ``capacity`` of each) both functions read; 0 with an
 * exception set where they do not fit together. */
static int check_state(Py_buffer *b, int depth, Py_ssize_t block, Py_ssize_t capacity) {
    if (depth < 0 || depth > 40 || block < 1 || capacity < 1) {
        PyErr_Format(PyExc_ValueError, "depth %d, block %zd, capacity %zd: out of range", depth, block, capacity);
        return 0;
    }
    return check(&b[0], 8, (Py_ssize_t)2 << depth, "tree") && check(&b[1], 8, capacity, "priority")
           && check(&b[2], 1, capacity, "flags");
}

/* ``b`` as int64 blocks, each a leaf of a tree of ``depth`` levels, and room for a
 * node per block (``*nodes``, to PyMem_RawFree); 0 with an exception set if not. */
static int leaf_blocks(Py_buffer *b, int depth, int64_t **nodes) {
    if (!check(b, 8, 0, "blocks"))
        return 0;
    const int64_t *blocks = b->buf;
    Py_ssize_t n = b->len / 8, leaves = (Py_ssize_t)1 << depth;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (blocks[i] < 0 || blocks[i] >= leaves) {
            PyErr_Format(PyExc_IndexError, "block %lld is not in [0, %zd)", (long long)blocks[i], leaves);
            return 0;
        }
    }
    *nodes = PyMem_RawMalloc((n ? n : 1) * sizeof(int64_t));
    if (*nodes == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    return 1;
}

/* Ask memory for the state of the block of slots from ``first``, before it is read. */
static inline void prefetch_block(const double *priority, const uint8_t *flags, Py_ssize_t first, Py_ssize_t block,
                                  Py_ssize_t capacity) {
    if (first < capacity) {
        __builtin_prefetch(&priority[first]);
        __builtin_prefetch(&priority[first + block - 1 < capacity ? first + block - 1 : capacity - 1]);
        __builtin_prefetch(&flags[first]);
    }
}

/* The first blocks of a batch asked of memory before the loop over it starts (block_span asks
 * for the rest, AHEAD of their reads). */
static void prefetch_blocks(const int64_t *blocks, Py_ssize_t n, const double *priority, const uint8_t *flags,
                            Py_ssize_t block, Py_ssize_t capacity) {
    for (Py_ssize_t i = 0; i < n && i < AHEAD; i++)
        prefetch_block(priority, flags, (Py_ssize_t)blocks[i] * block, block, capacity);
}

/* The slots [*first, *stop) of the batch's block ``i``, and the block AHEAD of it asked of memory. */
static inline void block_span(const int64_t *blocks, Py_ssize_t i, Py_ssize_t n, const double *priority,
                              const uint8_t *flags, Py_ssize_t block, Py_ssize_t capacity, Py_ssize_t *first,
                              Py_ssize_t *stop) {
    if (i + AHEAD < n)
        prefetch_block(priority, flags, (Py_ssize_t)blocks[i + AHEAD] * block, block, capacity);
    *first = (Py_ssize_t)blocks[i] * block;
    *stop = *first + block < capacity ? *first + block : capacity;
}

/* A batch's blocks read in chunks: their slots' state first copied (a chunk of blocks at a
 * time, ``CHUNK_SLOTS`` slots or one block), then their weights computed in place in one pass
 * over the chunk.  Copies are independent loads whose misses overlap, as a gather's do, and
 * the powers of a chunk run back to back.  Computed four at a time as each block was read (with
 * its lines asked of memory ahead), a block's powers waited on its miss and held back the loads
 * of the blocks after it: at 10^7 rows, 256 blocks took the search 210 us, 100-140 this way,
 * and the refresh 270 us, 90-150. */
#define CHUNK_SLOTS 2048

typedef struct {
    double *weight;    /* the chunk's blocks' priorities, then their weights, ``block`` a block */
    uint8_t *flags;    /* and their flags (0 past the capacity: no weight) */
    Py_ssize_t blocks; /* blocks a chunk */
} Copy;

/* Room for a chunk of blocks of ``block`` slots (and to the next multiple of 4); 0 with an
 * exception set if none. */
static int copy_new(Copy *c, Py_ssize_t block) {
    c->blocks = block < CHUNK_SLOTS ? CHUNK_SLOTS / block : 1;
    Py_ssize_t room = c->blocks * block + 4;
    c->weight = PyMem_RawMalloc(room * sizeof(double));
    c->flags = PyMem_RawMalloc(room);
    if (c->weight == NULL || c->flags == NULL) {
        PyMem_RawFree(c->weight);
        PyMem_RawFree(c->flags);
        PyErr_NoMemory();
        return 0;
    }
    return 1;
}

static void copy_free(Copy *c) {
    PyMem_RawFree(c->weight);
    PyMem_RawFree(c->flags);
}

/* Whether weights at ``exponent`` come from the vector power (else from weight(), exact at 1,
 * 0.5 and 0): every loop that computes a weight asks this, so all give the same bits. */
static inline int vector_powers(double exponent) {
    return have_vector_pow && exponent != 1.0 && exponent != 0.5 && exponent != 0.0;
}

/* Each of ``values[0:n]`` (priorities) replaced by its weight as a live slot's (room for n
 * rounded up to 4): the value copy_weights gives that priority, bit for bit. */
static void live_weights(double *values, Py_ssize_t n, double exponent) {
    if (!vector_powers(exponent)) {
        for (Py_ssize_t i = 0; i < n; i++)
            values[i] = weight(values[i], LIVE, exponent);
        return;
    }
    for (Py_ssize_t i = n; i % 4; i++)
        values[i] = 1.0;
    for (Py_ssize_t i = 0; i < n; i += 4)
        vector_pow4(values + i, exponent, values + i);
}

/* The weights of the slots of blocks ``leaf[i] - offset`` for i in [from, to) (at most
 * ``c->blocks``) into ``c->weight``, block after block: weight(), with the vector power
 * where there is one (every slot through it, so the search and the refresh see the same
 * weights whatever the grouping). */
static void copy_weights(Copy *c, const int64_t *leaf, int64_t offset, Py_ssize_t from, Py_ssize_t to,
                         const double *priority, const uint8_t *flags, double exponent, Py_ssize_t block,
                         Py_ssize_t capacity) {
    double *w = c->weight;
    Py_ssize_t slots = (to - from) * block;
    for (Py_ssize_t i = from; i < to; i++) {
        Py_ssize_t first = (Py_ssize_t)(leaf[i] - offset) * block, at = (i - from) * block;
        Py_ssize_t k = first >= capacity ? 0 : (first + block <= capacity ? block : capacity - first);
        memcpy(w + at, priority + first, k * sizeof(double));
        memcpy(c->flags + at, flags + first, k);
        for (Py_ssize_t j = k; j < block; j++) {
            w[at + j] = 1.0;
            c->flags[at + j] = 0;
        }
    }
    if (!vector_powers(exponent)) {
        for (Py_ssize_t s = 0; s < slots; s++)
            w[s] = weight(w[s], c->flags[s], exponent);
        return;
    }
    /* Rows often share one priority (the default, or the largest seen, as writers give it):
     * then one power for the chunk (the vector's, so the same weight as a slot at a time) */
    Py_ssize_t differs = 1;
    while (differs < slots && w[differs] == w[0])
        differs++;
    int same = differs == slots;
    for (Py_ssize_t s = slots; s % 4; s++)
        w[s] = 1.0;
    if (same && slots > 4) {
        double one[4] = {w[0], w[0], w[0], w[0]};
        vector_pow4(one, exponent, one);
        for (Py_ssize_t s = 0; s < slots; s++)
            w[s] = one[0];
    } else {
        for (Py_ssize_t s = 0; s < slots; s += 4)
            vector_pow4(w + s, exponent, w + s);
    }
    for (Py_ssize_t s = 0; s < slots; s++)
        w[s] = c->flags[s] & LIVE ? w[s] : 0.0;
}

/* The weight of a live slot of priority ``p``, as copy_weights computes it: the same value,
 * bit for bit. */
static double live_weight(double p, double exponent) {
    double four[4] = {p};
    live_weights(four, 1, exponent);
    return four[0];
}

/* Whether blocks ``blocks[from:to]`` (two or more) are whole, every slot live with one
 * priority (``*p``): an insert of rows given no priorities, or one for all.  Their sums are
 * then one block's, found once, with no copy of their state and no pass over their
 * weights (copy_weights: 6% of the server's CPU while 8 writers inserted 1 MiB batches).
 * Reads the state a copy would, and stops at the first slot that differs. */
static int uniform_blocks(const int64_t *blocks, Py_ssize_t from, Py_ssize_t to, const double *priority,
                          const uint8_t *flags, Py_ssize_t block, Py_ssize_t capacity, double *p) {
    if (to - from < 2)
        return 0;
    double first = priority[blocks[from] * block];
    for (Py_ssize_t i = from; i < to; i++) {
        Py_ssize_t at = (Py_ssize_t)blocks[i] * block;
        if (at + block > capacity)
            return 0;
        for (Py_ssize_t j = at; j < at + block; j++)
            if (priority[j] != first || !(flags[j] & LIVE))
                return 0;
    }
    *p = first;
    return 1;
}

static void release(Py_buffer *buffers, int n) {
    for (int i = 0; i < n; i++)
        if (buffers[i].obj != NULL)
            PyBuffer_Release(&buffers[i]);
}

PyDoc_STRVAR(find_doc,
"find(tree, depth, priority, flags, exponent, block, capacity, targets, slots, weights)\n\n"
"For each target (float64, in [0, total)), the first slot whose prefix sum of weights\n"
"passes it, into ``slots`` (int64), and that slot's weight into ``weights`` (float64).\n"
"``targets`` is overwritten (what is left of each within its block).");

static PyObject *find(PyObject *self, PyObject *args) {
    Py_buffer b[6] = {{0}};
    int depth;
    double exponent;
    Py_ssize_t block, capacity;
    if (!PyArg_ParseTuple(args, "y*iy*y*dnnw*w*w*", &b[0], &depth, &b[1], &b[2], &exponent, &block, &capacity,
                          &b[3], &b[4], &b[5]))
        goto fail;
    Py_ssize_t n = b[3].len / 8;
    if (!check_state(b, depth, block, capacity) || !check(&b[3], 8, 0, "targets") || !check(&b[4], 8, n, "slots")
        || !check(&b[5], 8, n, "weights"))
        goto fail;
    Py_ssize_t leaves = (Py_ssize_t)1 << depth;
    const double *tree = b[0].buf, *priority = b[1].buf;
    const uint8_t *flags = b[2].buf;
    double *u = b[3].buf, *out_weight = b[5].buf;
    int64_t *node = b[4].buf;  /* the nodes reached, then the slots found */
    Copy copy;
    if (!copy_new(&copy, block))
        goto fail;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        node[i] = 1;
    /* A level at a time for the whole batch: its loads are independent, so their misses overlap.
     * Right only where the target passes the left child and the right child has weight: a
     * target that rounding pushes past a subtree's sum stays on the side that has weight. */
    for (int level = 0; level < depth; level++) {
        int ahead = level >= PREFETCH_FROM;
        for (Py_ssize_t i = 0; ahead && i < n && i < AHEAD; i++)
            __builtin_prefetch(&tree[2 * node[i]]);
        for (Py_ssize_t i = 0; i < n; i++) {  /* without branches: a mispredicted one would stall on its load */
            if (ahead && i + AHEAD < n)
                __builtin_prefetch(&tree[2 * node[i + AHEAD]]);
            int64_t left = 2 * node[i];
            double left_sum = tree[left];
            int right = (u[i] >= left_sum) & (tree[left + 1] > 0.0);
            u[i] -= left_sum * (double)right;  /* (exact: times 1 or 0, and every sum is finite) */
            node[i] = left + right;
        }
    }
    for (Py_ssize_t from = 0; from < n; from += copy.blocks) {  /* then the blocks reached, a chunk at a time */
        Py_ssize_t to = from + copy.blocks < n ? from + copy.blocks : n;
        copy_weights(&copy, node, leaves, from, to, priority, flags, exponent, block, capacity);
        for (Py_ssize_t i = from; i < to; i++) {
            Py_ssize_t first = (Py_ssize_t)(node[i] - leaves) * block, at = (i - from) * block;
            Py_ssize_t stop = first + block < capacity ? first + block : capacity;
            Py_ssize_t found = -1, last = first < capacity ? first : capacity - 1;
            const double *ws = copy.weight + at - first;  /* (ws[s]: slot s's weight) */
            double sum = 0.0, last_weight = 0.0, w = 0.0;
            for (Py_ssize_t s = first; s < stop; s++) {
                w = ws[s];
                if (w > 0.0) {
                    last = s;
                    last_weight = w;
                }
                sum += w;
                if (sum > u[i]) {
                    found = s;
                    break;
                }
            }
            if (found < 0) { /* rounding: the block's last slot that has weight */
                found = last;
                w = last_weight;
            }
            node[i] = found;
            out_weight[i] = w;
        }
    }
    Py_END_ALLOW_THREADS
    copy_free(&copy);
    release(b, 6);
    Py_RETURN_NONE;
fail:
    release(b, 6);
    return NULL;
}

/* Leaves ``blocks[0:n]`` (each in [0, leaves)) summed again from their slots' weights, and the
 * node of each into ``nodes[i]``. */
static void sum_leaves(double *tree, Py_ssize_t leaves, const int64_t *blocks, Py_ssize_t n, int64_t *nodes,
                       Copy *copy, const double *priority, const uint8_t *flags, double exponent, Py_ssize_t block,
                       Py_ssize_t capacity) {
    double uniform = 0.0, uniform_sum = 0.0;  /* the priority of the last uniform chunk, and a block's sum */
    int have_uniform = 0;
    for (Py_ssize_t from = 0; from < n; from += copy->blocks) {
        Py_ssize_t to = from + copy->blocks < n ? from + copy->blocks : n;
        double p;
        if (uniform_blocks(blocks, from, to, priority, flags, block, capacity, &p)) {
            if (!have_uniform || p != uniform) {
                double w = live_weight(p, exponent), sum = 0.0;
                for (Py_ssize_t s = 0; s < block; s++)
                    sum += w;  /* (in the order the loop below adds a block's weights) */
                uniform = p;
                uniform_sum = sum;
                have_uniform = 1;
            }
            for (Py_ssize_t i = from; i < to; i++) {
                nodes[i] = leaves + blocks[i];
                tree[nodes[i]] = uniform_sum;
            }
            continue;
        }
        copy_weights(copy, blocks, 0, from, to, priority, flags, exponent, block, capacity);
        for (Py_ssize_t i = from; i < to && i < from + AHEAD; i++)  /* (the leaves to be written, as their parents below) */
            __builtin_prefetch(&tree[leaves + blocks[i]], 1);
        for (Py_ssize_t i = from; i < to; i++) {
            if (i + AHEAD < to)
                __builtin_prefetch(&tree[leaves + blocks[i + AHEAD]], 1);
            double sum = 0.0;
            for (Py_ssize_t s = (i - from) * block, stop = s + block; s < stop; s++)
                sum += copy->weight[s];
            nodes[i] = leaves + blocks[i];
            tree[nodes[i]] = sum;
        }
    }
}

/* Every node above leaves ``nodes[0:n]`` recomputed, a level at a time for the whole batch
 * (their loads overlap), each from children that are final by then.  Sorted leaves share
 * their ancestors in neighbours: a node is kept once a level (a run of an insert's 1,024
 * blocks asks 2,047 nodes, not 1,024 a level); one a caller's order leaves twice is
 * recomputed to the same value.  ``nodes`` is overwritten. */
static void sum_ancestors(double *tree, int64_t *nodes, Py_ssize_t n, int depth) {
    for (int level = 0; level < depth; level++) {
        Py_ssize_t kept = 0;
        int64_t last = 0;  /* (no node: the root's parent) */
        for (Py_ssize_t i = 0; i < n; i++) {
            if (i + AHEAD < n)  /* (the node to be written: its children were written a level before, and are cached) */
                __builtin_prefetch(&tree[nodes[i + AHEAD] >> 1], 1);
            int64_t node = nodes[i] >> 1;
            if (node == last)
                continue;
            tree[node] = tree[2 * node] + tree[2 * node + 1];
            nodes[kept++] = last = node;
        }
        n = kept;
    }
}

PyDoc_STRVAR(refresh_doc,
"refresh(tree, depth, priority, flags, exponent, block, capacity, blocks)\n\n"
"Recompute the leaves of ``blocks`` (int64, each in [0, leaves)) from their slots'\n"
"weights, then every node above them up to the root.");

static PyObject *refresh(PyObject *self, PyObject *args) {
    Py_buffer b[4] = {{0}};
    int depth;
    double exponent;
    Py_ssize_t block, capacity;
    if (!PyArg_ParseTuple(args, "w*iy*y*dnny*", &b[0], &depth, &b[1], &b[2], &exponent, &block, &capacity, &b[3]))
        goto fail;
    int64_t *nodes;
    if (!check_state(b, depth, block, capacity) || !leaf_blocks(&b[3], depth, &nodes))
        goto fail;
    Py_ssize_t n = b[3].len / 8;
    Copy copy;
    if (!copy_new(&copy, block)) {
        PyMem_RawFree(nodes);
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    sum_leaves(b[0].buf, (Py_ssize_t)1 << depth, b[3].buf, n, nodes, &copy, b[1].buf, b[2].buf, exponent, block,
               capacity);
    sum_ancestors(b[0].buf, nodes, n, depth);
    Py_END_ALLOW_THREADS
    copy_free(&copy);
    PyMem_RawFree(nodes);
    release(b, 4);
    Py_RETURN_NONE;
fail:
    release(b, 4);
    return NULL;
}

/* A leaf moved by differences keeps what bounds its error in 16 bits a block (``bounds``):
 * the moves since its block was last summed (the low 5 bits), and the largest value it has
 * held since, rounded up to 4 bits of mantissa (the high 11: 0 for none yet).  Each move rounds
 * the leaf by at most one ulp of that largest value (the difference, then the sum), so after k
 * moves its error is below k * 2^-52 of it.  A leaf moves only while it stays at half of that
 * value or more, and for at most 31 moves: its error stays below 62 * 2^-52 (1.4e-14) of its
 * value.  A move that would take it lower (a large weight made small, at once or step by step)
 * or to no weight sums the block instead, as does the 32nd, and so does a leaf outside
 * [2^-128, 2^126] (the 8 bits of exponent kept).  With random new priorities, 3% of moves sum
 * their block. */
#define MOVES 31
#define MOVE_BITS 5

/* The largest value ``bounds`` keeps (0 for none). */
static inline double bound_peak(uint16_t bounds) {
    int code = bounds >> 8;
    return code ? ldexp(1.0 + ((bounds >> MOVE_BITS) & 7) / 8.0, code - 129) : 0.0;
}

/* ``peak`` (> 0) rounded up to what bound_peak reads back, with ``moves``, as bounds; 0 where
 * it is out of their range. */
static inline int bound_of(double peak, int moves, uint16_t *out) {
    int e;
    double m = ceil((2.0 * frexp(peak, &e) - 1.0) * 8.0);  /* peak = (1 + m/8) * 2^(e-1), rounded up */
    if (m >= 8.0) {
        m = 0.0;
        e++;
    }
    if (e + 128 < 1 || e + 128 > 255)
        return 0;
    *out = (uint16_t)(((e + 128) << 8) | ((int)m << MOVE_BITS) | moves);
    return 1;
}

PyDoc_STRVAR(adjust_doc,
"adjust(tree, depth, priority, flags, exponent, block, capacity, slots, before, ordered, bounds)\n\n"
"After ``priority[slots]`` (int64, distinct) changed from ``before`` (float64): the leaf of\n"
"each slot's block moved by the change in its weight, or summed again from the block's slots\n"
"where a move would take it out of the bounds ``bounds`` (uint16 a block) keeps of its error;\n"
"then every node above the blocks of ``ordered`` (the same slots, sorted) up to the root.  A\n"
"priority update's refresh without the 16 powers and the three lines of every block it\n"
"touches: two powers and one line a slot.");

static PyObject *adjust(PyObject *self, PyObject *args) {
    Py_buffer b[7] = {{0}};  /* tree, priority, flags, slots, before, ordered, bounds */
    int depth;
    double exponent;
    Py_ssize_t block, capacity;
    if (!PyArg_ParseTuple(args, "w*iy*y*dnny*y*y*w*", &b[0], &depth, &b[1], &b[2], &exponent, &block, &capacity,
                          &b[3], &b[4], &b[5], &b[6]))
        goto fail;
    Py_ssize_t n = b[3].len / 8;
    if (!check_state(b, depth, block, capacity) || !check(&b[3], 8, 0, "slots") || !check(&b[4], 8, n, "before")
        || !check(&b[5], 8, n, "ordered") || !check(&b[6], 2, (capacity + block - 1) / block, "bounds")
        || !slots_in_range(b[3].buf, n, capacity) || !slots_in_range(b[5].buf, n, capacity))
        goto fail;
    double *tree = b[0].buf, *weights = PyMem_RawMalloc((2 * n + 8) * sizeof(double));
    const double *priority = b[1].buf, *before = b[4].buf;
    const uint8_t *flags = b[2].buf;
    const int64_t *slots = b[3].buf, *ordered = b[5].buf;
    uint16_t *bounds = b[6].buf;
    int64_t *nodes = PyMem_RawMalloc((n + 1) * sizeof(int64_t)), *redo = PyMem_RawMalloc((n + 1) * sizeof(int64_t));
    Copy copy = {0};
    if (weights == NULL || nodes == NULL || redo == NULL || !copy_new(&copy, block)) {
        PyMem_RawFree(weights);
        PyMem_RawFree(nodes);
        PyMem_RawFree(redo);
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t leaves = (Py_ssize_t)1 << depth, again = 0;
    double *now = weights, *was = weights + ((n + 3) & ~(Py_ssize_t)3);  /* (each from a multiple of 4) */
    for (Py_ssize_t i = 0; i < n; i++)  /* (just stored by the caller: in the caches) */
        now[i] = priority[slots[i]];
    memcpy(was, before, n * sizeof(double));
    live_weights(now, n, exponent);
    live_weights(was, n, exponent);
    for (Py_ssize_t i = 0; i < n && i < AHEAD; i++) {
        __builtin_prefetch(&tree[leaves + slots[i] / block], 1);
        __builtin_prefetch(&flags[slots[i]]);
        __builtin_prefetch(&bounds[slots[i] / block], 1);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            int64_t ahead = slots[i + AHEAD];
            __builtin_prefetch(&tree[leaves + ahead / block], 1);
            __builtin_prefetch(&flags[ahead]);
            __builtin_prefetch(&bounds[ahead / block], 1);
        }
        int64_t at = slots[i] / block;
        int live = flags[slots[i]] & LIVE;
        double w = live ? now[i] : 0.0, w_was = live ? was[i] : 0.0;
        if (w == w_was)
            continue;
        double leaf = tree[leaves + at], moved = leaf + (w - w_was);
        /* (the largest value held since the last sum: the one kept, the leaf's, the move's) */
        int moves = bounds[at] & MOVES;
        double peak = bound_peak(bounds[at]);
        peak = leaf > peak ? leaf : peak;
        peak = moved > peak ? moved : peak;
        uint16_t kept;
        if (w > 0.0 && moves < MOVES && moved >= 0.5 * peak && bound_of(peak, moves + 1, &kept)) {
            tree[leaves + at] = moved;
            bounds[at] = kept;
        } else {
            redo[again++] = at;
        }
    }
    sum_leaves(tree, leaves, redo, again, nodes, &copy, priority, flags, exponent, block, capacity);
    for (Py_ssize_t i = 0; i < again; i++)
        bounds[redo[i]] = 0;  /* (summed: no error, nothing held since) */
    for (Py_ssize_t i = 0; i < n; i++)
        nodes[i] = leaves + ordered[i] / block;
    sum_ancestors(tree, nodes, n, depth);
    Py_END_ALLOW_THREADS
    copy_free(&copy);
    PyMem_RawFree(weights);
    PyMem_RawFree(nodes);
    PyMem_RawFree(redo);
    release(b, 7);
    Py_RETURN_NONE;
fail:
    release(b, 7);
    return NULL;
}

/* Slot a orders before slot b by (priority, key), a live slot before a dead one or none (-1);
 * of two equal, a. */
static inline int64_t lower(int64_t a, int64_t b, const double *priority, const int64_t *key) {
    if (b < 0)
        return a;
    if (a < 0)
        return b;
    double pa = priority[a], pb = priority[b];
    return (pa < pb || (pa == pb && key[a] <= key[b])) ? a : b;
}

PyDoc_STRVAR(refresh_lowest_doc,
"refresh_lowest(tree, depth, priority, key, flags, block, capacity, blocks)\n\n"
"The lowest-priority order's argmin tree (int64 slots, -1: none): recompute the leaves\n"
"of ``blocks`` (each the live slot of its block with the lowest (priority, key)), then\n"
"every node above them up to the root.");

static PyObject *refresh_lowest(PyObject *self, PyObject *args) {
    Py_buffer b[5] = {{0}};  /* tree, priority, flags, key, blocks */
    int depth;
    Py_ssize_t block, capacity;
    if (!PyArg_ParseTuple(args, "w*iy*y*y*nny*", &b[0], &depth, &b[1], &b[3], &b[2], &block, &capacity, &b[4]))
        goto fail;
    int64_t *nodes;
    if (!check_state(b, depth, block, capacity) || !check(&b[3], 8, capacity, "key")
        || !leaf_blocks(&b[4], depth, &nodes))
        goto fail;
    Py_ssize_t n = b[4].len / 8, leaves = (Py_ssize_t)1 << depth;
    const int64_t *blocks = b[4].buf;
    int64_t *tree = b[0].buf;
    const double *priority = b[1].buf;
    const uint8_t *flags = b[2].buf;
    const int64_t *key = b[3].buf;
    Py_BEGIN_ALLOW_THREADS
    prefetch_blocks(blocks, n, priority, flags, block, capacity);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t first, stop;
        block_span(blocks, i, n, priority, flags, block, capacity, &first, &stop);
        int64_t best = -1;
        for (Py_ssize_t s = first; s < stop; s++)
            if (flags[s] & LIVE)
                best = lower(best, s, priority, key);
        nodes[i] = leaves + blocks[i];
        tree[nodes[i]] = best;
    }
    /* the nodes above, a level at a time for the batch (as refresh's) */
    for (int level = 0; level < depth; level++) {
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t node = nodes[i] >> 1;
            tree[node] = lower(tree[2 * node], tree[2 * node + 1], priority, key);
            nodes[i] = node;
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(nodes);
    release(b, 5);
    Py_RETURN_NONE;
fail:
    release(b, 5);
    return NULL;
}

/* Of two slots of an age order's tree (-1: none), the one first in the order: the lower key,
 * or with ``newest`` the higher (keys are distinct); ``a`` when neither is first. */
static inline int64_t first_in_age(int64_t a, int64_t b, const int64_t *key, int newest) {
    if (b < 0)
        return a;
    if (a < 0)
        return b;
    return (newest ? key[a] >= key[b] : key[a] <= key[b]) ? a : b;
}

PyDoc_STRVAR(filled_run_doc,
"filled_run(tree, depth, key, flags, block, capacity, first, stop, newest)\n\n"
"An age order's argmin tree (int64 slots, -1: none; the oldest row first, or the newest\n"
"with ``newest``) after slots ``first`` to ``stop`` (exclusive) were all given rows whose\n"
"keys rise with the slot (a ring buffer's insert).  A node whose slots all lie in the run\n"
"holds its first slot (its last, newest first); at most two nodes a level cover the run in\n"
"part: a leaf's from the live slots of its block, a node's above from its two children.");

static PyObject *filled_run(PyObject *self, PyObject *args) {
    Py_buffer b[3] = {{0}};  /* tree, key, flags */
    int depth, newest;
    Py_ssize_t block, capacity, first, stop;
    if (!PyArg_ParseTuple(args, "w*iy*y*nnnnp", &b[0], &depth, &b[1], &b[2], &block, &capacity, &first, &stop,
                          &newest))
        goto fail;
    if (depth < 0 || depth > 40 || block < 1 || capacity < 1 || capacity > block * ((Py_ssize_t)1 << depth)) {
        PyErr_Format(PyExc_ValueError, "depth %d, block %zd, capacity %zd: out of range", depth, block, capacity);
        goto fail;
    }
    if (first < 0 || stop <= first || stop > capacity) {
        PyErr_Format(PyExc_IndexError, "slots %zd to %zd are not a run in [0, %zd)", first, stop, capacity);
        goto fail;
    }
    if (!check(&b[0], 8, (Py_ssize_t)2 << depth, "tree") || !check(&b[1], 8, capacity, "key")
        || !check(&b[2], 1, capacity, "flags"))
        goto fail;
    int64_t *tree = b[0].buf;
    const int64_t *key = b[1].buf;
    const uint8_t *flags = b[2].buf;
    Py_ssize_t leaves = (Py_ssize_t)1 << depth, base = leaves, width = block;
    Py_ssize_t low = first / block, high = (stop - 1) / block;  /* the level's nodes the run touches */
    for (;;) {
        Py_ssize_t full_low = (first + width - 1) / width;
        Py_ssize_t full_high = stop == capacity ? high : stop / width - 1;  /* (the last node may be short) */
        for (Py_ssize_t i = full_low; i <= full_high; i++)
            tree[base + i] = newest ? (((i + 1) * width < capacity ? (i + 1) * width : capacity) - 1) : i * width;
        for (int end = 0; end < 2; end++) {  /* the nodes the run covers in part: its first, its last */
            Py_ssize_t i = end ? high : low;
            if ((end && high == low) || (i >= full_low && i <= full_high))
                continue;
            if (base == leaves) {
                Py_ssize_t s = i * block, until = s + block < capacity ? s + block : capacity;
                int64_t best = -1;
                for (; s < until; s++)
                    if (flags[s] & LIVE)
                        best = first_in_age(best, s, key, newest);
                tree[base + i] = best;
            } else {
                tree[base + i] = first_in_age(tree[2 * (base + i)], tree[2 * (base + i) + 1], key, newest);
            }
        }
        if (base == 1)
            break;
        base >>= 1, width <<= 1, low >>= 1, high >>= 1;
    }
    release(b, 3);
    Py_RETURN_NONE;
fail:
    release(b, 3);
    return NULL;
}

PyDoc_STRVAR(first_bad_doc,
"first_bad(priorities, exponent, max_weight) -> int\n\n"
"The index of the first of ``priorities`` (float64) that is not a finite number >= 0, else\n"
"of the first whose weight (priority ** exponent) is not finite or is over ``max_weight``;\n"
"-1 if none.");

static PyObject *first_bad(PyObject *self, PyObject *args) {
    Py_buffer b = {0};
    double exponent, max_weight;
    if (!PyArg_ParseTuple(args, "y*dd", &b, &exponent, &max_weight))
        return NULL;
    if (!check(&b, 8, 0, "priorities")) {
        PyBuffer_Release(&b);
        return NULL;
    }
    const double *p = b.buf;
    Py_ssize_t n = b.len / 8, bad = -1;
    Py_BEGIN_ALLOW_THREADS
    /* Every priority a finite number >= 0 first, the largest found on the way.  With an
     * exponent >= 0 a weight grows with its priority: the largest one's weight passes only
     * where every weight does, so one power for the batch, not one a row (16,384 rows: a
     * power each took 0.3 ms, a third of an insert); where it fails (or the exponent is
     * negative), the weights are looked at one by one for the first that fails. */
    double largest = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {  /* (NaN fails every comparison: ``!(x >= y)`` catches it) */
        if (!(p[i] >= 0.0) || !isfinite(p[i])) {
            bad = i;
            break;
        }
        largest = p[i] > largest ? p[i] : largest;
    }
    double top = weight(largest, LIVE, exponent);
    int every_weight_passes = exponent >= 0.0 && isfinite(top) && top <= max_weight;
    for (Py_ssize_t i = 0; bad < 0 && !every_weight_passes && i < n; i++) {
        double w = weight(p[i], LIVE, exponent);
        if (!isfinite(w) || !(w <= max_weight))
            bad = i;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromSsize_t(bad);
}

PyDoc_STRVAR(count_doc,
"count(times_sampled, slots, limit)\n\n"
"Each of ``slots`` (int64, repeats allowed, each in [0, len(times_sampled))) sampled once\n"
"more: its count (uint32) grows by one, up to ``limit``.  Nothing is written if a slot is\n"
"out of range.");

static PyObject *count(PyObject *self, PyObject *args) {
    Py_buffer b[2] = {{0}};
    unsigned long limit;
    if (!PyArg_ParseTuple(args, "w*y*k", &b[0], &b[1], &limit))
        goto fail;
    if (!check(&b[0], 4, 0, "times_sampled") || !check(&b[1], 8, 0, "slots"))
        goto fail;
    uint32_t *times = b[0].buf;
    const int64_t *slots = b[1].buf;
    Py_ssize_t n = b[1].len / 8, capacity = b[0].len / 4;
    if (!slots_in_range(slots, n, capacity))
        goto fail;
    uint32_t top = limit > UINT32_MAX ? UINT32_MAX : (uint32_t)limit;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && i < AHEAD; i++)
        __builtin_prefetch(&times[slots[i]], 1);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n)
            __builtin_prefetch(&times[slots[i + AHEAD]], 1);
        uint32_t *t = &times[slots[i]];
        *t += *t < top;
    }
    Py_END_ALLOW_THREADS
    release(b, 2);
    Py_RETURN_NONE;
fail:
    release(b, 2);
    return NULL;
}

PyDoc_STRVAR(locate_doc,
"locate(key, keys, slots)\n\n"
"The slot of each of ``keys`` (int64) into ``slots`` (int64): ``k % len(key)`` where the\n"
"table's ``key`` array (int64) holds ``k`` there, else -1 (and -1 for a negative key).");

static PyObject *locate(PyObject *self, PyObject *args) {
    Py_buffer b[3] = {{0}};  /* the table's keys, the keys asked for, their slots */
    if (!PyArg_ParseTuple(args, "y*y*w*", &b[0], &b[1], &b[2]))
        goto fail;
    if (!check(&b[0], 8, 1, "key") || !check(&b[1], 8, 0, "keys") || !check(&b[2], 8, b[1].len / 8, "slots"))
        goto fail;
    const int64_t *key = b[0].buf, *keys = b[1].buf;
    int64_t *slots = b[2].buf;
    Py_ssize_t n = b[1].len / 8;
    int64_t capacity = b[0].len / 8;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && i < AHEAD; i++)
        if (keys[i] >= 0)
            __builtin_prefetch(&key[keys[i] % capacity]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n && keys[i + AHEAD] >= 0)
            __builtin_prefetch(&key[keys[i + AHEAD] % capacity]);
        int64_t k = keys[i], slot = k >= 0 ? k % capacity : 0;
        slots[i] = k >= 0 && key[slot] == k ? slot : -1;
    }
    Py_END_ALLOW_THREADS
    release(b, 3);
    Py_RETURN_NONE;
fail:
    release(b, 3);
    return NULL;
}

PyDoc_STRVAR(gather_doc,
"gather(column, row_bytes, slots, out)\n\n"
"Rows ``slots`` (int64, repeats allowed, each in [0, len(column) // row_bytes)) of\n"
"``column`` (C-contiguous rows of ``row_bytes`` bytes, in memory or mapped) into ``out``\n"
"(writable, at least ``len(slots) * row_bytes`` bytes), in order.  Each row's lines are\n"
"asked of memory a few rows ahead of its copy: numpy's take copies a row after the other,\n"
"and a sample's rows of a large table (each a cache miss) waited on one miss at a time.\n"
"Nothing is copied if a slot is out of range.");

/* Lines of a row asked of memory ahead of its copy: the first few (a wide row's later lines
 * follow the first in order, and the hardware's own prefetcher finds them). */
#define ROW_LINES 4
/* Rows ahead: with up to two lines a row (a 56-byte row spans two lines half the time),
 * about as many loads in flight as the refresh's AHEAD blocks of state. */
#define ROWS_AHEAD 8

static inline void prefetch_row(const char *column, int64_t slot, Py_ssize_t row_bytes) {
    const char *row = column + slot * row_bytes;
    Py_ssize_t span = row_bytes < ROW_LINES * 64 ? row_bytes : ROW_LINES * 64;
    for (Py_ssize_t at = 0; at < span; at += 64)
        __builtin_prefetch(row + at);
    __builtin_prefetch(row + span - 1);  /* (a row that starts mid-line ends on one more) */
}

static PyObject *gather(PyObject *self, PyObject *args) {
    Py_buffer b[3] = {{0}};  /* the column, the slots, out */
    Py_ssize_t row_bytes;
    if (!PyArg_ParseTuple(args, "y*ny*w*", &b[0], &row_bytes, &b[1], &b[2]))
        goto fail;
    if (row_bytes < 1 || b[0].len % row_bytes != 0) {
        PyErr_Format(PyExc_ValueError, "gather: a column of %zd bytes is not rows of %zd", b[0].len, row_bytes);
        goto fail;
    }
    if (!check(&b[1], 8, 0, "slots"))
        goto fail;
    Py_ssize_t n = b[1].len / 8, rows = b[0].len / row_bytes;
    if (b[2].len / row_bytes < n) {
        PyErr_Format(PyExc_ValueError, "gather: %zd rows of %zd bytes do not fit in %zd bytes", n, row_bytes,
                     b[2].len);
        goto fail;
    }
    const char *column = b[0].buf;
    const int64_t *slots = b[1].buf;
    char *out = b[2].buf;
    if (!slots_in_range(slots, n, rows))
        goto fail;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && i < ROWS_AHEAD; i++)
        prefetch_row(column, slots[i], row_bytes);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + ROWS_AHEAD < n)
            prefetch_row(column, slots[i + ROWS_AHEAD], row_bytes);
        memcpy(out + i * row_bytes, column + slots[i] * row_bytes, (size_t)row_bytes);
    }
    Py_END_ALLOW_THREADS
    release(b, 3);
    Py_RETURN_NONE;
fail:
    release(b, 3);
    return NULL;
}

PyDoc_STRVAR(scatter_doc,
"scatter(array, slots, values[, replaced])\n\n"
"``array[slots[i]] = values[i]`` for 8-byte items (``array`` writable; ``slots`` int64, each\n"
"in [0, len(array)); a slot given twice keeps its last value), and the value each store\n"
"replaced into ``replaced[i]`` where given, each item's line asked of memory ahead of its\n"
"store: numpy's assignment stores one scattered item after the other, and each waits on its\n"
"line (a priority update's 256 rows of 10^7).  Nothing is written if a slot is out of range.");

static PyObject *scatter(PyObject *self, PyObject *args) {
    Py_buffer b[4] = {{0}};  /* the array, the slots, the values, the values replaced */
    if (!PyArg_ParseTuple(args, "w*y*y*|w*", &b[0], &b[1], &b[2], &b[3]))
        goto fail;
    if (!check(&b[0], 8, 0, "array") || !check(&b[1], 8, 0, "slots") || !check(&b[2], 8, b[1].len / 8, "values")
        || (b[3].obj != NULL && !check(&b[3], 8, b[1].len / 8, "replaced")))
        goto fail;
    char *array = b[0].buf, *replaced = b[3].buf;
    const int64_t *slots = b[1].buf;
    const char *values = b[2].buf;
    Py_ssize_t n = b[1].len / 8, length = b[0].len / 8;
    if (!slots_in_range(slots, n, length))
        goto fail;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && i < AHEAD; i++)
        __builtin_prefetch(array + slots[i] * 8, 1);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n)
            __builtin_prefetch(array + slots[i + AHEAD] * 8, 1);
        if (replaced != NULL)
            memcpy(replaced + i * 8, array + slots[i] * 8, 8);
        memcpy(array + slots[i] * 8, values + i * 8, 8);
    }
    Py_END_ALLOW_THREADS
    release(b, 4);
    Py_RETURN_NONE;
fail:
    release(b, 4);
    return NULL;
}

PyDoc_STRVAR(distinct_rising_doc,
"distinct_rising(values, shift, out) -> int\n\n"
"The distinct values of ``values >> shift`` (int64, ``values`` in rising order, repeats\n"
"allowed) into ``out`` (int64, at least as long), in order; returns how many, or -1 (``out``\n"
"then undefined) if ``values`` do not rise.  An update's blocks from its sorted slots in one\n"
"pass: numpy's way (a check that they rise, a comparison of neighbours, a mask) was five\n"
"calls of a few microseconds each.");

static PyObject *distinct_rising(PyObject *self, PyObject *args) {
    Py_buffer b[2] = {{0}};
    int shift;
    if (!PyArg_ParseTuple(args, "y*iw*", &b[0], &shift, &b[1]))
        goto fail;
    if (shift < 0 || shift > 62) {
        PyErr_Format(PyExc_ValueError, "distinct_rising: a shift of %d", shift);
        goto fail;
    }
    if (!check(&b[0], 8, 0, "values") || !check(&b[1], 8, b[0].len / 8, "out"))
        goto fail;
    const int64_t *values = b[0].buf;
    int64_t *out = b[1].buf;
    Py_ssize_t n = b[0].len / 8, k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i && values[i] < values[i - 1]) {
            k = -1;
            break;
        }
        int64_t v = values[i] >> shift;
        if (!k || out[k - 1] != v)
            out[k++] = v;
    }
    release(b, 2);
    return PyLong_FromSsize_t(k);
fail:
    release(b, 2);
    return NULL;
}

PyDoc_STRVAR(stream_copy_doc,
"stream_copy(dst, src)\n\n"
"Copy the bytes of ``src`` into ``dst`` (writable; both C-contiguous, the same length) with\n"
"stores that go around the caches where the CPU has them (SSE2): a batch's rows going into\n"
"a table's columns in memory are written once and not read back soon, and a copy into\n"
"memory not in the caches first reads every line it writes (1 MiB: 125 us with memcpy's\n"
"stores here, 55 us with these).");

static PyObject *stream_copy(PyObject *self, PyObject *args) {
    Py_buffer b[2] = {{0}};
    if (!PyArg_ParseTuple(args, "w*y*", &b[0], &b[1]))
        goto fail;
    if (b[0].len != b[1].len) {
        PyErr_Format(PyExc_ValueError, "stream_copy: %zd bytes into %zd", b[1].len, b[0].len);
        goto fail;
    }
    char *d = b[0].buf;
    const char *s = b[1].buf;
    Py_ssize_t n = b[0].len;
    Py_BEGIN_ALLOW_THREADS
#if defined(__SSE2__)
    if (n >= 64) {
        Py_ssize_t head = (Py_ssize_t)((16 - ((uintptr_t)d & 15)) & 15);  /* until d is 16-byte aligned */
        memcpy(d, s, (size_t)head);
        d += head, s += head, n -= head;
        for (; n >= 64; n -= 64, d += 64, s += 64) {
            __m128i x0 = _mm_loadu_si128((const __m128i *)s), x1 = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i x2 = _mm_loadu_si128((const __m128i *)(s + 32)), x3 = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)d, x0);
            _mm_stream_si128((__m128i *)(d + 16), x1);
            _mm_stream_si128((__m128i *)(d + 32), x2);
            _mm_stream_si128((__m128i *)(d + 48), x3);
        }
        _mm_sfence();  /* the streamed stores are seen before anything after this copy */
    }
#endif
    memcpy(d, s, (size_t)n);
    Py_END_ALLOW_THREADS
    release(b, 2);
    Py_RETURN_NONE;
fail:
    release(b, 2);
    return NULL;
}

PyDoc_STRVAR(is_run_doc,
"is_run(values, step) -> bool\n\n"
"Whether ``values`` (int64, C-contiguous) go up by ``step`` from each to the next (in\n"
"int64 arithmetic, wrapping as numpy's does).  One pass, no temporaries: numpy's check\n"
"made three passes and two temporaries, several times an insert.");

/* Whether v[1..n) each differ from the one before by s, in wrapping arithmetic. */
static int steps_all(const uint64_t *v, Py_ssize_t n, uint64_t s) {
    Py_ssize_t i = 1;
#if defined(__SSE2__)
    /* two differences an instruction, in chunks of 64 with no branch inside; a break
     * ends the scan at the end of its chunk (gcc -O2 left the plain loop scalar: 16,384
     * values took 8.5 us) */
    const __m128i step = _mm_set1_epi64x((long long)s), zero = _mm_setzero_si128();
    for (; i + 64 <= n; i += 64) {
        __m128i off = zero;
        for (Py_ssize_t j = i; j < i + 64; j += 2) {
            __m128i now = _mm_loadu_si128((const __m128i *)(v + j));
            __m128i before = _mm_loadu_si128((const __m128i *)(v + j - 1));
            off = _mm_or_si128(off, _mm_xor_si128(_mm_sub_epi64(now, before), step));
        }
        if (_mm_movemask_epi8(_mm_cmpeq_epi8(off, zero)) != 0xFFFF)
            return 0;
    }
#endif
    uint64_t off = 0;
    for (; i < n; i++)
        off |= (v[i] - v[i - 1]) ^ s;
    return off == 0;
}

static PyObject *is_run(PyObject *self, PyObject *args) {
    Py_buffer b = {0};
    long long step;
    if (!PyArg_ParseTuple(args, "y*L", &b, &step))
        return NULL;
    if (!check(&b, 8, 0, "values")) {
        PyBuffer_Release(&b);
        return NULL;
    }
    /* (unsigned: a wrapping difference is not undefined) */
    int run = steps_all(b.buf, b.len / 8, (uint64_t)step);
    PyBuffer_Release(&b);
    return PyBool_FromLong(run);
}

static PyMethodDef methods[] = {
    {"locate", locate, METH_VARARGS, locate_doc},
    {"find", find, METH_VARARGS, find_doc},
    {"refresh", refresh, METH_VARARGS, refresh_doc},
    {"adjust", adjust, METH_VARARGS, adjust_doc},
    {"refresh_lowest", refresh_lowest, METH_VARARGS, refresh_lowest_doc},
    {"filled_run", filled_run, METH_VARARGS, filled_run_doc},
    {"first_bad", first_bad, METH_VARARGS, first_bad_doc},
    {"count", count, METH_VARARGS, count_doc},
    {"gather", gather, METH_VARARGS, gather_doc},
    {"scatter", scatter, METH_VARARGS, scatter_doc},
    {"distinct_rising", distinct_rising, METH_VARARGS, distinct_rising_doc},
    {"stream_copy", stream_copy, METH_VARARGS, stream_copy_doc},
    {"is_run", is_run, METH_VARARGS, is_run_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_loops",
    "The tables' hot loops, compiled (see compiled.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__loops(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    find_vector_pow();
    /* whether the blocks' powers are glibc's vector ones (the benchmark and the tests say so) */
    if (PyModule_AddIntConstant(m, "vector_pow", have_vector_pow) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
