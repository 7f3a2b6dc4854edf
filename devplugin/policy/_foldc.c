/* The allocator's tree fold in C: fold.py's fold where every state is the
 * empty one (the tree expresses every pair's score), the reference this
 * must agree with value for value and choice for choice.
 *
 * Why C, and why the whole walk: placement and preemption fold thousands of
 * times per request, and in Python the walk over the tree's nodes costs far
 * more than the (min, +) convolutions it calls (those are 5-11% of the
 * Python fold's time), so a compiled convolution alone would leave most of
 * the cost. Here the values are signed 128-bit integers; fold_tables.py
 * builds a Tables object only when every value a fold can reach fits (see
 * NATIVE_BITS there), otherwise the allocator keeps the Python fold. It
 * knows nothing of the objective's terms or weights: it adds the rows
 * fold_tables.py composed (each class's values, each node's finishing row
 * for each free room below it) and, per call, the value of covering a
 * partner at each level, and hands back the best value and the counts
 * (objective.Weights reads the terms back).
 *
 * The GIL is held for the whole call: a fold takes microseconds, and holding
 * it lets one scratch arena per Tables serve calls without locks. Building
 * the answer allocates Python objects; should that ever run a collection
 * whose finalizer folds again, or lets another thread in (not seen: 3.11
 * takes these objects from free lists, 3.12 collects only between
 * bytecodes), the second call takes an arena of its own. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef __int128 i128;

/* ---- conversions ------------------------------------------------------ */

static int to_i128(PyObject *obj, i128 *out) {
    /* value = high * 2**64 + low, low in [0, 2**64): Python's >> floors and
     * & takes two's-complement bits, so negative values split the same way. */
    PyObject *mask = NULL, *shift = NULL, *low_obj = NULL, *high_obj = NULL;
    int ok = -1;
    mask = PyLong_FromUnsignedLongLong(UINT64_MAX);
    shift = PyLong_FromLong(64);
    if (mask == NULL || shift == NULL) goto done;
    low_obj = PyNumber_And(obj, mask);
    high_obj = PyNumber_Rshift(obj, shift);
    if (low_obj == NULL || high_obj == NULL) goto done;
    {
        unsigned long long low = PyLong_AsUnsignedLongLong(low_obj);
        if (low == (unsigned long long)-1 && PyErr_Occurred()) goto done;
        long long high = PyLong_AsLongLong(high_obj);
        if (high == -1 && PyErr_Occurred()) goto done;
        *out = (i128)(((unsigned __int128)(uint64_t)high << 64) | (unsigned __int128)low);
    }
    ok = 0;
done:
    Py_XDECREF(mask);
    Py_XDECREF(shift);
    Py_XDECREF(low_obj);
    Py_XDECREF(high_obj);
    return ok;
}

static PyObject *from_i128(i128 value) {
    long long high = (long long)(value >> 64);
    unsigned long long low = (unsigned long long)(uint64_t)value;
    if (high == 0) return PyLong_FromUnsignedLongLong(low);
    if (high == -1 && (low >> 63)) return PyLong_FromLongLong((long long)low);
    PyObject *h = PyLong_FromLongLong(high);
    PyObject *l = PyLong_FromUnsignedLongLong(low);
    PyObject *shift = PyLong_FromLong(64);
    PyObject *shifted = NULL, *result = NULL;
    if (h && l && shift) shifted = PyNumber_Lshift(h, shift);
    if (shifted) result = PyNumber_Add(shifted, l);
    Py_XDECREF(h);
    Py_XDECREF(l);
    Py_XDECREF(shift);
    Py_XDECREF(shifted);
    return result;
}

/* A row of Python ints as a new C array (length in *len). */
static i128 *row_of(PyObject *seq, Py_ssize_t *len) {
    PyObject *fast = PySequence_Fast(seq, "a row must be a sequence of ints");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    i128 *row = PyMem_Malloc(sizeof(i128) * (size_t)(n > 0 ? n : 1));
    if (row == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (to_i128(PySequence_Fast_GET_ITEM(fast, i), &row[i]) < 0) {
            PyMem_Free(row);
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    *len = n;
    return row;
}

/* The items of a fast sequence, each in [0, limit), into out. */
static int read_ints(PyObject *fast, int *out, long limit, const char *what) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) return -1;
        if (v < 0 || v >= limit) {
            PyErr_Format(PyExc_ValueError, "%s: item %zd (%ld) out of range", what, i, v);
            return -1;
        }
        out[i] = (int)v;
    }
    return 0;
}

/* Small non-negative ints (counts) into an int array of exactly n. */
static int ints_of(PyObject *seq, int *out, Py_ssize_t n, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL) return -1;
    int rc = -1;
    if (PySequence_Fast_GET_SIZE(fast) != n)
        PyErr_Format(PyExc_ValueError, "%s: expected %zd items", what, n);
    else
        rc = read_ints(fast, out, (long)INT32_MAX + 1, what);
    Py_DECREF(fast);
    return rc;
}

/* ---- the tables ------------------------------------------------------- */

typedef struct {
    int node, level;
    int nchildren, nmine, nothers;
    int *children, *mine, *others;
} WalkNode;

typedef struct {
    PyObject_HEAD
    int nnodes, nclasses, nwalk;
    WalkNode *walk;
    /* class_values[c * 6 + per] with length class_len[c] (0: not this kind). */
    i128 **class_values;
    Py_ssize_t *class_len;
    /* Per node, its finishing rows by free room below it (fold_tables.py's
     * finish_row for each room): fin_rooms[n] rooms (0: none), the row for
     * room r at fin_vals[n] + fin_off[n][r], fin_off[n][r + 1] - that long. */
    int *fin_rooms;
    Py_ssize_t **fin_off;
    i128 **fin_vals;
    i128 inf;
    /* Scratch reused by every call (the GIL is held throughout a call). */
    i128 *arena;
    size_t arena_cap;
    int arena_busy; /* a call is using the arena */
} Tables;

static void tables_free_parts(Tables *t) {
    if (t->walk) {
        for (int i = 0; i < t->nwalk; i++) {
            PyMem_Free(t->walk[i].children);
            PyMem_Free(t->walk[i].mine);
            PyMem_Free(t->walk[i].others);
        }
        PyMem_Free(t->walk);
        t->walk = NULL;
    }
    if (t->class_values) {
        for (int i = 0; i < t->nclasses * 6; i++) PyMem_Free(t->class_values[i]);
        PyMem_Free(t->class_values);
        t->class_values = NULL;
    }
    if (t->fin_vals) {
        for (int i = 0; i < t->nnodes; i++) PyMem_Free(t->fin_vals[i]);
        PyMem_Free(t->fin_vals);
        t->fin_vals = NULL;
    }
    if (t->fin_off) {
        for (int i = 0; i < t->nnodes; i++) PyMem_Free(t->fin_off[i]);
        PyMem_Free(t->fin_off);
        t->fin_off = NULL;
    }
    PyMem_Free(t->fin_rooms);
    t->fin_rooms = NULL;
    PyMem_Free(t->class_len);
    t->class_len = NULL;
    PyMem_Free(t->arena);
    t->arena = NULL;
    t->arena_cap = 0;
}

static void Tables_dealloc(Tables *self) {
    tables_free_parts(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Indices below limit into a new array (*count of them). */
static int tuple_ints(PyObject *obj, int **out, int *count, int limit, const char *what) {
    PyObject *fast = PySequence_Fast(obj, what);
    if (fast == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    *count = (int)n;
    *out = PyMem_Malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
    int rc = -1;
    if (*out == NULL)
        PyErr_NoMemory();
    else
        rc = read_ints(fast, *out, limit, what);
    Py_DECREF(fast);
    return rc;
}

/* One node's finishing rows (a sequence of rows, one per room) into the
 * flat arrays of node n. */
static int finish_rows_of(Tables *self, int n, PyObject *rows) {
    PyObject *fast = PySequence_Fast(rows, "finish rows");
    if (fast == NULL) return -1;
    Py_ssize_t rooms = PySequence_Fast_GET_SIZE(fast), total = 0;
    Py_ssize_t *off = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(rooms + 1));
    i128 **parts = PyMem_Calloc((size_t)(rooms > 0 ? rooms : 1), sizeof(i128 *));
    int rc = -1;
    if (off == NULL || parts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t r = 0; r < rooms; r++) {
        Py_ssize_t len = 0;
        parts[r] = row_of(PySequence_Fast_GET_ITEM(fast, r), &len);
        if (parts[r] == NULL) goto done;
        off[r] = total;
        total += len;
    }
    off[rooms] = total;
    i128 *vals = PyMem_Malloc(sizeof(i128) * (size_t)(total > 0 ? total : 1));
    if (vals == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t r = 0; r < rooms; r++)
        memcpy(vals + off[r], parts[r], sizeof(i128) * (size_t)(off[r + 1] - off[r]));
    self->fin_vals[n] = vals;
    self->fin_off[n] = off;
    self->fin_rooms[n] = (int)rooms;
    off = NULL;
    rc = 0;
done:
    if (parts != NULL)
        for (Py_ssize_t r = 0; r < rooms; r++) PyMem_Free(parts[r]);
    PyMem_Free(parts);
    PyMem_Free(off);
    Py_DECREF(fast);
    return rc;
}

/* Tables(nnodes, walk, class_values, finish, inf)
 * walk: (node, level, children, mine, others) per node, children first;
 * class_values: per class None or six rows (one per cost level);
 * finish: per node None or its finishing rows, one per free room below it.
 * The rows are the objective's, weighted and composed by fold_tables.py:
 * this fold only adds them. */
static int Tables_init(Tables *self, PyObject *args, PyObject *kwargs) {
    int nnodes;
    PyObject *walk, *class_values, *finish, *inf;
    static char *names[] = {"nnodes", "walk", "class_values", "finish", "inf", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iOOOO", names, &nnodes, &walk,
                                     &class_values, &finish, &inf))
        return -1;
    tables_free_parts(self);
    if (nnodes <= 0) {
        PyErr_SetString(PyExc_ValueError, "nnodes must be positive");
        return -1;
    }
    self->nnodes = nnodes;
    if (to_i128(inf, &self->inf) < 0) return -1;

    /* Classes. */
    PyObject *classes = PySequence_Fast(class_values, "class_values");
    if (classes == NULL) return -1;
    self->nclasses = (int)PySequence_Fast_GET_SIZE(classes);
    int nclasses = self->nclasses;
    self->class_values = PyMem_Calloc((size_t)(nclasses > 0 ? nclasses : 1) * 6, sizeof(i128 *));
    self->class_len = PyMem_Calloc((size_t)(nclasses > 0 ? nclasses : 1), sizeof(Py_ssize_t));
    if (self->class_values == NULL || self->class_len == NULL) {
        Py_DECREF(classes);
        PyErr_NoMemory();
        return -1;
    }
    for (int c = 0; c < nclasses; c++) {
        PyObject *rows = PySequence_Fast_GET_ITEM(classes, c);
        if (rows == Py_None) continue;
        PyObject *fast = PySequence_Fast(rows, "class rows");
        if (fast == NULL || PySequence_Fast_GET_SIZE(fast) != 6) {
            Py_XDECREF(fast);
            Py_DECREF(classes);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "class_values: six rows per class");
            return -1;
        }
        for (int per = 0; per < 6; per++) {
            Py_ssize_t len = 0;
            i128 *row = row_of(PySequence_Fast_GET_ITEM(fast, per), &len);
            if (row == NULL) {
                Py_DECREF(fast);
                Py_DECREF(classes);
                return -1;
            }
            self->class_values[c * 6 + per] = row;
            if (per == 0) self->class_len[c] = len;
            if (len != self->class_len[c] || len < 1) {
                Py_DECREF(fast);
                Py_DECREF(classes);
                PyErr_SetString(PyExc_ValueError, "class_values: rows of one class differ");
                return -1;
            }
        }
        Py_DECREF(fast);
    }
    Py_DECREF(classes);

    /* Per-node finishing rows. */
    self->fin_rooms = PyMem_Calloc((size_t)nnodes, sizeof(int));
    self->fin_off = PyMem_Calloc((size_t)nnodes, sizeof(Py_ssize_t *));
    self->fin_vals = PyMem_Calloc((size_t)nnodes, sizeof(i128 *));
    if (!self->fin_rooms || !self->fin_off || !self->fin_vals) {
        PyErr_NoMemory();
        return -1;
    }
    {
        PyObject *fast = PySequence_Fast(finish, "finish");
        if (fast == NULL) return -1;
        if (PySequence_Fast_GET_SIZE(fast) != nnodes) {
            Py_DECREF(fast);
            PyErr_SetString(PyExc_ValueError, "finish: one entry per node");
            return -1;
        }
        for (int n = 0; n < nnodes; n++) {
            PyObject *rows = PySequence_Fast_GET_ITEM(fast, n);
            if (rows != Py_None && finish_rows_of(self, n, rows) < 0) {
                Py_DECREF(fast);
                return -1;
            }
        }
        Py_DECREF(fast);
    }

    /* The walk. */
    PyObject *wf = PySequence_Fast(walk, "walk");
    if (wf == NULL) return -1;
    self->nwalk = (int)PySequence_Fast_GET_SIZE(wf);
    self->walk = PyMem_Calloc((size_t)(self->nwalk > 0 ? self->nwalk : 1), sizeof(WalkNode));
    if (self->walk == NULL) {
        Py_DECREF(wf);
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < self->nwalk; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(wf, i);
        PyObject *node, *level, *children, *mine, *others;
        if (!PyArg_ParseTuple(item, "OOOOO", &node, &level, &children, &mine, &others)) {
            Py_DECREF(wf);
            return -1;
        }
        WalkNode *w = &self->walk[i];
        w->node = (int)PyLong_AsLong(node);
        w->level = (int)PyLong_AsLong(level);
        if (PyErr_Occurred()) {
            Py_DECREF(wf);
            return -1;
        }
        if (w->node < 0 || w->node >= nnodes || w->level < 0 || w->level > 5) {
            Py_DECREF(wf);
            PyErr_SetString(PyExc_ValueError, "walk: node or level out of range");
            return -1;
        }
        if (tuple_ints(children, &w->children, &w->nchildren, nnodes, "children") < 0 ||
            tuple_ints(mine, &w->mine, &w->nmine, nclasses, "mine") < 0 ||
            tuple_ints(others, &w->others, &w->nothers, nclasses, "others") < 0) {
            Py_DECREF(wf);
            return -1;
        }
        for (int m = 0; m < w->nmine; m++) {
            if (self->class_len[w->mine[m]] == 0) {
                Py_DECREF(wf);
                PyErr_SetString(PyExc_ValueError, "walk: a class of this kind has no rows");
                return -1;
            }
        }
    }
    Py_DECREF(wf);
    return 0;
}

/* ---- the fold --------------------------------------------------------- */

typedef struct {
    const i128 *p;
    Py_ssize_t len;
    int nothing; /* the shared "takes nothing" row ([0]) */
} Row;

typedef struct {
    int is_class, item;
    Row row, before, merged;
} Step;

static const i128 ZERO_ROW[1] = {0};

static inline i128 imin(i128 a, i128 b) { return b < a ? b : a; }

/* Takes n values from the arena; NULL when the bound computed up front was
 * wrong (an internal error, reported rather than overrun). */
static i128 *take(i128 *arena, size_t cap, size_t *used, Py_ssize_t n) {
    if (*used + (size_t)n > cap) return NULL;
    i128 *p = arena + *used;
    *used += (size_t)n;
    return p;
}

/* out[s] = min over a + b = s of first[a] + second[b] for s <= high; the
 * same three cases as allocator._convolve, so the same slots are filled. */
static Py_ssize_t convolve(const i128 *first, Py_ssize_t lf, const i128 *second, Py_ssize_t ls,
                           Py_ssize_t low, Py_ssize_t high, i128 inf, i128 *out) {
    if (ls == 2 || lf == 2) {
        if (ls != 2) {
            const i128 *tp = first;
            first = second;
            second = tp;
            Py_ssize_t tl = lf;
            lf = ls;
            ls = tl;
        }
        i128 zero = second[0], one = second[1];
        Py_ssize_t n = lf + 1;
        if (n > high + 1) n = high + 1;
        for (Py_ssize_t s = 0; s < n; s++) {
            i128 a = s < lf ? first[s] + zero : inf;
            i128 b = s >= 1 ? first[s - 1] + one : inf;
            out[s] = imin(a, b);
        }
        return n;
    }
    Py_ssize_t n = high + 1;
    for (Py_ssize_t s = 0; s < n; s++) out[s] = inf;
    i128 half = inf >> 1;
    if (low <= 0 && high == lf + ls - 2) {
        for (Py_ssize_t taken = 0; taken < ls; taken++) {
            i128 value = second[taken];
            if (value < half) {
                i128 *o = out + taken;
                for (Py_ssize_t i = 0; i < lf; i++) o[i] = imin(o[i], first[i] + value);
            }
        }
        return n;
    }
    for (Py_ssize_t taken = 0; taken < ls; taken++) {
        i128 value = second[taken];
        if (value >= half) continue;
        Py_ssize_t start = low - taken > 0 ? low - taken : 0;
        Py_ssize_t stop = high - taken + 1 < lf ? high - taken + 1 : lf;
        for (Py_ssize_t i = start; i < stop; i++)
            out[i + taken] = imin(out[i + taken], first[i] + value);
    }
    return n;
}

/* fold(cap, must, cost, partner, other, size, prune, cover_unit)
 * prune: classes whose cost level is above it take nothing (-1: none);
 * cover_unit: per level (0-5), the value of a partner first covered there
 * (fold_tables.FoldTables.cover_units). Returns None (no such choice) or
 * (value, {class: count}). */
static PyObject *Tables_fold(Tables *self, PyObject *args) {
    PyObject *cap_o, *must_o, *cost_o, *partner_o, *other_o, *units_o;
    int size, threshold;
    if (!PyArg_ParseTuple(args, "OOOOOiiO", &cap_o, &must_o, &cost_o, &partner_o, &other_o,
                          &size, &threshold, &units_o))
        return NULL;
    if (self->walk == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Tables not initialised");
        return NULL;
    }
    if (size < 0 || threshold < -1 || threshold > 5) {
        PyErr_SetString(PyExc_ValueError, "size or prune out of range");
        return NULL;
    }
    i128 cover_unit[6];
    {
        PyObject *fast = PySequence_Fast(units_o, "cover_unit");
        if (fast == NULL) return NULL;
        int bad = PySequence_Fast_GET_SIZE(fast) != 6;
        for (int level = 0; !bad && level < 6; level++)
            bad = to_i128(PySequence_Fast_GET_ITEM(fast, level), &cover_unit[level]) < 0;
        Py_DECREF(fast);
        if (bad) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "cover_unit: expected one value per level");
            return NULL;
        }
    }
    const int prune = threshold >= 0;
    const int nn = self->nnodes, nc = self->nclasses;
    const i128 inf = self->inf;
    PyObject *result = NULL;
    i128 *own_arena = NULL; /* set when another call holds the shared arena */
    int holds_arena = 0;

    /* Per-call integer scratch: five class arrays, four node arrays. */
    int *ints = PyMem_Malloc(sizeof(int) * (size_t)(5 * nc + 4 * nn + 2));
    Row *class_rows = PyMem_Malloc(sizeof(Row) * (size_t)(nc + 1));
    Row *node_values = PyMem_Malloc(sizeof(Row) * (size_t)nn);
    int nsteps_max = 0;
    for (int i = 0; i < self->nwalk; i++)
        nsteps_max += self->walk[i].nchildren + self->walk[i].nmine;
    Step *steps = PyMem_Malloc(sizeof(Step) * (size_t)(nsteps_max + 1));
    int *stack = PyMem_Malloc(sizeof(int) * 2 * (size_t)(nn + 1));
    if (!ints || !class_rows || !node_values || !steps || !stack) {
        PyErr_NoMemory();
        goto out;
    }
    int *cap = ints, *must = cap + nc, *cost = must + nc, *partner = cost + nc,
        *other = partner + nc;
    int *free_ = other + nc, *targets = free_ + nn, *capacity = targets + nn,
        *step_start = capacity + nn;
    int *step_count = PyMem_Malloc(sizeof(int) * (size_t)nn);
    if (step_count == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    if (ints_of(cap_o, cap, nc, "cap") < 0 || ints_of(must_o, must, nc, "must") < 0 ||
        ints_of(cost_o, cost, nc, "cost") < 0 ||
        ints_of(partner_o, partner, nc, "partner") < 0 ||
        ints_of(other_o, other, nc, "other") < 0)
        goto out_counts;
    for (int c = 0; c < nc; c++) {
        if (cost[c] > 5) {
            PyErr_SetString(PyExc_ValueError, "cost: a level is at most 5");
            goto out_counts;
        }
    }

    /* The arena: a bound on every row a call writes (class rows with
     * must-include prefixes, children rows with partners covered, merges,
     * and each node's finished row), each at most size + 1 long, plus the
     * class rows' own lengths. */
    size_t need = 0;
    for (int c = 0; c < nc; c++) need += (size_t)self->class_len[c] + (size_t)must[c] + 1;
    need += (size_t)(2 * nsteps_max + 2 * nn + 2) * (size_t)(size + 2);
    if (self->arena_busy) {
        own_arena = PyMem_Malloc(sizeof(i128) * need);
        if (own_arena == NULL) {
            PyErr_NoMemory();
            goto out_counts;
        }
    } else if (need > self->arena_cap) {
        i128 *grown = PyMem_Realloc(self->arena, sizeof(i128) * need);
        if (grown == NULL) {
            PyErr_NoMemory();
            goto out_counts;
        }
        self->arena = grown;
        self->arena_cap = need;
    }
    if (own_arena == NULL) {
        self->arena_busy = 1;
        holds_arena = 1;
    }
    i128 *arena = own_arena != NULL ? own_arena : self->arena;
    size_t acap = own_arena != NULL ? need : self->arena_cap, used = 0;

    Row nothing = {ZERO_ROW, 1, 1};
    /* A child the walk has not reached yet (malformed tables) reads as
     * taking nothing rather than as stray memory. */
    for (int n = 0; n < nn; n++) {
        node_values[n] = nothing;
        free_[n] = targets[n] = capacity[n] = 0;
        step_start[n] = step_count[n] = 0;
    }
    Py_ssize_t total = 0;
    for (int c = 0; c < nc; c++) {
        class_rows[c] = nothing;
        if (!cap[c] || self->class_len[c] == 0) continue;
        int per = cost[c], need = must[c];
        if (prune && per > threshold) {
            if (need) {
                i128 *r = take(arena, acap, &used, 1);
                if (r == NULL) goto overrun;
                r[0] = inf;
                class_rows[c] = (Row){r, 1, 0};
            }
        } else {
            Py_ssize_t len = self->class_len[c];
            Py_ssize_t want = (cap[c] < size ? cap[c] : size) + 1;
            if (want < len) len = want;
            const i128 *src = self->class_values[c * 6 + per];
            if (need) {
                /* [inf] * need + values[need:] */
                Py_ssize_t tail = len > need ? len - need : 0;
                i128 *r = take(arena, acap, &used, need + tail);
                if (r == NULL) goto overrun;
                for (int i = 0; i < need; i++) r[i] = inf;
                for (Py_ssize_t i = 0; i < tail; i++) r[need + i] = src[need + i];
                class_rows[c] = (Row){r, need + tail, 0};
            } else {
                class_rows[c] = (Row){src, len, 0};
            }
        }
        total += class_rows[c].len - 1;
    }

    int nsteps = 0;
    for (int w = 0; w < self->nwalk; w++) {
        const WalkNode *fn = &self->walk[w];
        const int node = fn->node;
        const i128 unit = cover_unit[fn->level];
        Row current = nothing;
        i128 zero = 0, shift = 0;
        Py_ssize_t below = 0;
        int room = 0, waiting = 0;
        step_start[node] = nsteps;
        /* Children, then classes of this kind: one loop over both. */
        for (int i = 0; i < fn->nchildren + fn->nmine; i++) {
            int is_class = i >= fn->nchildren;
            int item = is_class ? fn->mine[i - fn->nchildren] : fn->children[i];
            Row row;
            if (!is_class) {
                Row values = node_values[item];
                int pending = targets[item];
                room += free_[item];
                i128 first = values.p[0];
                zero += first;
                i128 adjusted = first;
                row = values;
                if (pending) {
                    waiting += pending;
                    adjusted = first + (i128)pending * unit;
                    if (values.len > 1) {
                        i128 *r = take(arena, acap, &used, values.len);
                        if (r == NULL) goto overrun;
                        r[0] = adjusted;
                        memcpy(r + 1, values.p + 1, sizeof(i128) * (size_t)(values.len - 1));
                        row = (Row){r, values.len, 0};
                    }
                }
                if (values.len == 1) {
                    shift += adjusted;
                    continue;
                }
                below += capacity[item];
            } else {
                Row values = class_rows[item];
                room += cap[item];
                if (values.nothing) continue;
                zero += values.p[0];
                if (values.len == 1) {
                    shift += values.p[0];
                    continue;
                }
                below += values.len - 1;
                row = values;
            }
            Row merged;
            if (current.nothing) {
                merged = row;
            } else {
                Py_ssize_t high = current.len + row.len - 2;
                if (high > size) high = size;
                i128 *r = take(arena, acap, &used, high + 1);
                if (r == NULL) goto overrun;
                Py_ssize_t n = convolve(current.p, current.len, row.p, row.len,
                                        (Py_ssize_t)size - (total - below), high, inf, r);
                merged = (Row){r, n, 0};
            }
            steps[nsteps++] = (Step){is_class, item, row, current, merged};
            current = merged;
        }
        for (int i = 0; i < fn->nothers; i++) {
            int c = fn->others[i];
            room += other[c];
            if (partner[c]) {
                waiting += partner[c];
                shift += (i128)partner[c] * unit;
            }
        }
        free_[node] = room;
        targets[node] = waiting;
        capacity[node] = (int)below;
        step_count[node] = nsteps - step_start[node];

        /* The node's own row: shifted, its zero slot set, its finish added. */
        const i128 *end = NULL;
        Py_ssize_t len = current.len;
        if (self->fin_rooms[node]) {
            if (room >= self->fin_rooms[node]) goto past_finish;
            const Py_ssize_t *off = self->fin_off[node];
            end = self->fin_vals[node] + off[room];
            if (off[room + 1] - off[room] < len) len = off[room + 1] - off[room];
        }
        i128 *r = take(arena, acap, &used, len > 0 ? len : 1);
        if (r == NULL) goto overrun;
        for (Py_ssize_t k = 0; k < current.len && k < len; k++) r[k] = current.p[k] + shift;
        if (current.len > 0 && r[0] != zero && len > 0) r[0] = zero;
        if (end != NULL)
            for (Py_ssize_t k = 0; k < len; k++) r[k] += end[k];
        node_values[node] = (Row){r, len, 0};
    }

    {
        Row root = node_values[0];
        i128 best = root.len > size ? root.p[size] : inf;
        if (best >= inf >> 1) {
            result = Py_NewRef(Py_None);
            goto out_counts;
        }
        PyObject *counts = PyDict_New();
        if (counts == NULL) goto out_counts;
        int depth = 0;
        stack[depth++] = 0;
        stack[depth++] = size;
        while (depth) {
            int k = stack[--depth];
            int node = stack[--depth];
            for (int s = step_start[node] + step_count[node] - 1; s >= step_start[node]; s--) {
                if (!k) break;
                const Step *st = &steps[s];
                if (k >= st->merged.len) goto walk_error;
                i128 goal = st->merged.p[k];
                /* The largest count of this item that reaches the best value. */
                int take_n = k < st->row.len - 1 ? k : (int)(st->row.len - 1);
                while (take_n >= 0 &&
                       (k - take_n >= st->before.len ||
                        st->before.p[k - take_n] + st->row.p[take_n] != goal))
                    take_n--;
                if (take_n < 0) goto walk_error;
                if (take_n) {
                    if (st->is_class) {
                        PyObject *key = PyLong_FromLong(st->item);
                        PyObject *val = PyLong_FromLong(take_n);
                        int rc = (key && val) ? PyDict_SetItem(counts, key, val) : -1;
                        Py_XDECREF(key);
                        Py_XDECREF(val);
                        if (rc < 0) {
                            Py_DECREF(counts);
                            goto out_counts;
                        }
                    } else {
                        if (depth + 2 > 2 * (nn + 1)) goto walk_error;
                        stack[depth++] = st->item;
                        stack[depth++] = take_n;
                    }
                }
                k -= take_n;
            }
        }
        PyObject *value = from_i128(best);
        if (value == NULL) {
            Py_DECREF(counts);
            goto out_counts;
        }
        result = PyTuple_Pack(2, value, counts);
        Py_DECREF(value);
        Py_DECREF(counts);
        goto out_counts;
    walk_error:
        Py_DECREF(counts);
        PyErr_SetString(PyExc_RuntimeError, "fold: the walk back found no decomposition");
        goto out_counts;
    }

overrun:
    PyErr_SetString(PyExc_RuntimeError, "fold: scratch bound exceeded");
    goto out_counts;
past_finish:
    PyErr_SetString(PyExc_RuntimeError, "fold: more room below a node than its finishing rows");
out_counts:
    PyMem_Free(step_count);
    PyMem_Free(own_arena);
    if (holds_arena) self->arena_busy = 0;
out:
    PyMem_Free(ints);
    PyMem_Free(class_rows);
    PyMem_Free(node_values);
    PyMem_Free(steps);
    PyMem_Free(stack);
    return result;
}

static PyMethodDef Tables_methods[] = {
    {"fold", (PyCFunction)Tables_fold, METH_VARARGS,
     "fold(cap, must, cost, partner, other, size, prune, cover_unit)"
     " -> None | (value, counts)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TablesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "devplugin.policy._foldc.Tables",
    .tp_basicsize = sizeof(Tables),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One kind's fold tables for one topology.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Tables_init,
    .tp_dealloc = (destructor)Tables_dealloc,
    .tp_methods = Tables_methods,
};

static struct PyModuleDef foldc_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "devplugin.policy._foldc",
    .m_doc = "The allocator's tree fold on 128-bit integers.",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__foldc(void) {
    if (PyType_Ready(&TablesType) < 0) return NULL;
    PyObject *module = PyModule_Create(&foldc_module);
    if (module == NULL) return NULL;
    Py_INCREF(&TablesType);
    if (PyModule_AddObject(module, "Tables", (PyObject *)&TablesType) < 0) {
        Py_DECREF(&TablesType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
