/* The sampling hot path's per-sample loops (service/kernels/__init__.py wraps them; the samplers and batch
 * modes call them).
 *
 * Each array argument's item type, length, contiguity and alignment are checked on entry (a mismatch raises
 * TypeError or ValueError naming the argument), and every computed row is wrapped onto the ring before it
 * indexes a table, so tables a lock-free reader reads mid-write can give wrong answers (which the reader
 * detects and redraws) but never an access outside an array.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
#include <numpy/arrayobject.h>
#include <numpy/random/distributions.h>
#include <math.h>
#include <stdint.h>
#include <stdatomic.h>
#include <string.h>

#define OPEN (-1)
#define HOLE (-2)
#define TERMINATED 4
/* Copies above this many bytes, and loops over more than this many samples, run with the GIL released (for
 * less, releasing it costs more than the other threads gain). */
#define RELEASE_GIL_BYTES (1 << 16)
#define RELEASE_GIL_SAMPLES 4096
/* The most columns a batch mode prefetches the rows of. */
#define PREFETCH_COLUMNS 4

static inline PyThreadState *release_gil_if(int large) { return large ? PyEval_SaveThread() : NULL; }
static inline void restore_gil(PyThreadState *released) {
    if (released) PyEval_RestoreThread(released);
}

/* ------------------------------------------------------------------ arguments */

/* A C-contiguous, aligned array of `type` (any number or bool type: -1), writable if asked, of at least
 * `min_items` items; NULL with TypeError or ValueError naming the argument otherwise. A borrowed reference. */
static PyArrayObject *array_arg(PyObject *obj, const char *name, int type, int writable, npy_intp min_items) {
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "kernel argument %s: expected a numpy array, got %s", name,
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    PyArrayObject *array = (PyArrayObject *)obj;
    if (type < 0 && !PyTypeNum_ISNUMBER(PyArray_TYPE(array)) && !PyTypeNum_ISBOOL(PyArray_TYPE(array))) {
        /* a byte copy of other types would copy references (object) or pointers to managed memory (strings) */
        PyErr_Format(PyExc_TypeError, "kernel argument %s: expected numbers or bools, got %s", name,
                     PyArray_DESCR(array)->typeobj->tp_name);
        return NULL;
    }
    if (type >= 0 && !PyArray_EquivTypenums(PyArray_TYPE(array), type)) {
        PyArray_Descr *expected = PyArray_DescrFromType(type);
        PyErr_Format(PyExc_TypeError, "kernel argument %s: expected %s items, got %s", name,
                     expected->typeobj->tp_name, PyArray_DESCR(array)->typeobj->tp_name);
        Py_DECREF(expected);
        return NULL;
    }
    if (!PyArray_IS_C_CONTIGUOUS(array) || !PyArray_ISALIGNED(array) || !PyArray_ISNOTSWAPPED(array)) {
        PyErr_Format(PyExc_ValueError, "kernel argument %s: expected a C-contiguous, aligned, native array", name);
        return NULL;
    }
    if (writable && !PyArray_ISWRITEABLE(array)) {
        PyErr_Format(PyExc_ValueError, "kernel argument %s: expected a writable array", name);
        return NULL;
    }
    if (PyArray_SIZE(array) < min_items) {
        PyErr_Format(PyExc_ValueError, "kernel argument %s: expected at least %zd items, got %zd", name,
                     (Py_ssize_t)min_items, (Py_ssize_t)PyArray_SIZE(array));
        return NULL;
    }
    return array;
}

static Py_ssize_t items(PyArrayObject *array) { return (Py_ssize_t)PyArray_SIZE(array); }

static int int_arg(PyObject *obj, const char *name, int64_t *out) {
    long long value = PyLong_AsLongLong(obj);
    if (value == -1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "kernel argument %s: expected an int", name);
        return -1;
    }
    *out = (int64_t)value;
    return 0;
}

static int check_nargs(const char *function, Py_ssize_t nargs, Py_ssize_t expected) {
    if (nargs == expected) return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", function, expected, nargs);
    return -1;
}

/* A row index wrapped onto the ring; divides only when it is off the ring. */
static inline int64_t wrap(int64_t row, int64_t capacity) {
    if (row >= 0 && row < capacity) return row;
    row %= capacity;
    return row < 0 ? row + capacity : row;
}

/* ------------------------------------------------------------------ bound lookup */

/* The arguments after `positions` of the bound-lookup kernels (EpisodicRing.bound_tables). */
typedef struct {
    int64_t capacity;
    const int64_t *row_end, *row_seq, *extent_last;
    int64_t extent_slots;
    const int64_t *times_sampled; /* NULL: no remover retires steps */
    int64_t max_times_sampled;
} Tables;

static int tables_arg(PyObject *const *args, Tables *tables) {
    PyArrayObject *row_end, *row_seq, *extent_last, *times_sampled;
    if (int_arg(args[0], "capacity", &tables->capacity) || int_arg(args[4], "extent_slots", &tables->extent_slots)
        || int_arg(args[6], "max_times_sampled", &tables->max_times_sampled))
        return -1;
    if (tables->capacity < 1 || tables->extent_slots < 1) {
        PyErr_SetString(PyExc_ValueError, "kernel arguments capacity and extent_slots must be >= 1");
        return -1;
    }
    if (!(row_end = array_arg(args[1], "row_end", NPY_INT64, 0, tables->capacity))
        || !(row_seq = array_arg(args[2], "row_seq", NPY_INT64, 0, tables->capacity))
        || !(extent_last = array_arg(args[3], "extent_last", NPY_INT64, 0, tables->extent_slots))
        || !(times_sampled = array_arg(args[5], "times_sampled", NPY_INT64, 0, 0)))
        return -1;
    if (items(times_sampled) && items(times_sampled) < tables->capacity) {
        PyErr_Format(PyExc_ValueError, "kernel argument times_sampled: expected 0 or >= %lld items, got %zd",
                     (long long)tables->capacity, items(times_sampled));
        return -1;
    }
    tables->row_end = PyArray_DATA(row_end);
    tables->row_seq = PyArray_DATA(row_seq);
    tables->extent_last = PyArray_DATA(extent_last);
    tables->times_sampled = items(times_sampled) ? PyArray_DATA(times_sampled) : NULL;
    return 0;
}

/* bounds, closed and open_seq of ring rows (each in 0..capacity-1). */
static void bounds_of_rows(Py_ssize_t count, const int64_t *rows, const Tables *t, int64_t *bounds, char *closed,
                           int64_t *open_seq) {
    for (Py_ssize_t i = 0; i < count; i++) bounds[i] = t->row_end[rows[i]]; /* the random reads alone */
    /* A lock-free reader reads a row's bound before its row_seq and extent record, which the writer stores
       first (x86 keeps both orders; this keeps the compiler from moving the later loads above). */
    atomic_signal_fence(memory_order_seq_cst);
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t row = rows[i], bound = bounds[i], seq = -1;
        closed[i] = 1;
        if (bound == OPEN) { /* the open episode's bound is its last landed row, kept in the extent table */
            seq = t->row_seq[row];
            /* A lock-free reader may find the row turned into a hole since (its episode moved): no item. */
            bound = seq >= 0 ? t->extent_last[seq % t->extent_slots] : HOLE;
            closed[i] = 0;
        }
        if (t->times_sampled && t->times_sampled[row] >= t->max_times_sampled) bound = HOLE; /* retired */
        bounds[i] = bound;
        open_seq[i] = seq;
    }
}

/* episode_bounds(positions, capacity, row_end, row_seq, extent_last, extent_slots, times_sampled,
 *                max_times_sampled, located (3, n) int64: rows, bounds, open_seq; closed (n,) bool) */
static PyObject *episode_bounds(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Tables tables;
    PyArrayObject *positions, *located, *closed;
    if (check_nargs("episode_bounds", nargs, 10) || !(positions = array_arg(args[0], "positions", NPY_INT64, 0, 0))
        || tables_arg(args + 1, &tables))
        return NULL;
    Py_ssize_t count = items(positions);
    if (!(located = array_arg(args[8], "located", NPY_INT64, 1, 3 * count))
        || !(closed = array_arg(args[9], "closed", NPY_BOOL, 1, count)))
        return NULL;
    const int64_t *keys = PyArray_DATA(positions);
    int64_t *rows = PyArray_DATA(located), *bounds = rows + count, *open_seq = rows + 2 * count;
    PyThreadState *released = release_gil_if(count > RELEASE_GIL_SAMPLES);
    for (Py_ssize_t i = 0; i < count; i++) rows[i] = wrap(keys[i], tables.capacity);
    bounds_of_rows(count, rows, &tables, bounds, PyArray_DATA(closed), open_seq);
    restore_gil(released);
    Py_RETURN_NONE;
}

/* The bit generator of a numpy Generator's `bit_generator.capsule`; the caller holds its lock. */
static bitgen_t *bit_generator_arg(PyObject *capsule) {
    bitgen_t *bit_generator = PyCapsule_GetPointer(capsule, "BitGenerator");
    if (!bit_generator) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "kernel argument bit_generator: expected a BitGenerator's capsule");
    }
    return bit_generator;
}

/* draw_uniform(bit_generator, batch_size, low, high, candidates_per_step, max_rounds, capacity, row_end, row_seq,
 *              extent_last, extent_slots, times_sampled, max_times_sampled)
 *   -> (positions, rows, bounds, closed, open_seq): a Draw's arrays of B items (int64, closed bool), or None if
 *      max_rounds fell short
 *
 * Rejection sampling over [low, high): each round draws int(missing * candidates_per_step) + 8 uniforms (the
 * numbers Generator.random(that many) would give) and keeps, in draw order, the candidates that are steps. */
static PyObject *draw_uniform(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Tables tables;
    bitgen_t *bit_generator;
    int64_t batch, low, high, max_rounds;
    if (check_nargs("draw_uniform", nargs, 13) || !(bit_generator = bit_generator_arg(args[0]))
        || int_arg(args[1], "batch_size", &batch) || int_arg(args[2], "low", &low) || int_arg(args[3], "high", &high)
        || int_arg(args[5], "max_rounds", &max_rounds) || tables_arg(args + 6, &tables))
        return NULL;
    double candidates_per_step = PyFloat_AsDouble(args[4]);
    if (candidates_per_step == -1.0 && PyErr_Occurred()) return NULL;
    if (high <= low) Py_RETURN_NONE; /* an empty live range (a lock-free reader racing evictions): no step */
    if (batch < 1 || batch > (1 << 30) || !(candidates_per_step > 0.0 && candidates_per_step <= 1e6)) {
        PyErr_SetString(PyExc_ValueError,
                        "draw_uniform: expected batch_size in 1..2^30 and candidates_per_step in (0, 1e6]");
        return NULL;
    }
    npy_intp shape[1] = {batch};
    double most_candidates = batch * candidates_per_step + 8; /* the first round draws the most */
    if (most_candidates * (4 * sizeof(int64_t) + 1) > (double)PY_SSIZE_T_MAX / 2) return PyErr_NoMemory();
    Py_ssize_t most = (Py_ssize_t)most_candidates;
    /* A Draw's fields as arrays of their own: views of one (4, B) array cost more to slice in Python. */
    PyObject *drawn = PyTuple_New(5);
    for (Py_ssize_t j = 0; drawn && j < 5; j++) {
        PyObject *array = PyArray_SimpleNew(1, shape, j == 3 ? NPY_BOOL : NPY_INT64);
        if (!array) Py_CLEAR(drawn);
        else PyTuple_SET_ITEM(drawn, j, array);
    }
    char *scratch = drawn ? PyMem_Malloc(most * (4 * sizeof(int64_t) + 1)) : NULL;
    if (!scratch) {
        Py_XDECREF(drawn);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    double *uniforms = (double *)scratch;
    int64_t *rows = (int64_t *)(uniforms + most), *bounds = rows + most, *open_seq = bounds + most;
#define DRAWN(J) PyArray_DATA((PyArrayObject *)PyTuple_GET_ITEM(drawn, J))
    char *candidate_closed = (char *)(open_seq + most), *closed = DRAWN(3);
    int64_t *out_positions = DRAWN(0), *out_rows = DRAWN(1), *out_bounds = DRAWN(2), *out_open_seq = DRAWN(4);
#undef DRAWN
    int64_t span = high - low, low_row = wrap(low, tables.capacity), filled = 0;
    PyThreadState *released = release_gil_if(batch > RELEASE_GIL_SAMPLES);
    for (int64_t round = 0; round < max_rounds && filled < batch; round++) {
        Py_ssize_t count = (Py_ssize_t)((batch - filled) * candidates_per_step) + 8;
        /* The uniforms are drawn here one by one (random_standard_uniform_fill's very draws) and each row's bound
           is prefetched as soon as the row is known: the generator's work overlaps the bound reads' misses. */
        if (span <= tables.capacity) {
            /* A row is at most one lap ahead. Whether it is, is a coin flip once the live range wraps round the
               ring: a conditional move, not a branch that mispredicts half the time. */
            for (Py_ssize_t i = 0; i < count; i++) {
                uniforms[i] = next_double(bit_generator);
                int64_t row = low_row + (int64_t)(uniforms[i] * span);
                rows[i] = row >= tables.capacity ? row - tables.capacity : row;
                __builtin_prefetch(tables.row_end + rows[i]);
            }
        } else { /* a lock-free reader's torn range */
            for (Py_ssize_t i = 0; i < count; i++) {
                uniforms[i] = next_double(bit_generator);
                rows[i] = wrap(low_row + (int64_t)(uniforms[i] * span), tables.capacity);
            }
        }
        bounds_of_rows(count, rows, &tables, bounds, candidate_closed, open_seq);
        for (Py_ssize_t i = 0; i < count && filled < batch; i++) {
            int64_t position = low + (int64_t)(uniforms[i] * span);
            if (position < bounds[i]) { /* a step: it has a successor in its episode */
                out_positions[filled] = position;
                out_rows[filled] = rows[i];
                out_bounds[filled] = bounds[i];
                out_open_seq[filled] = open_seq[i];
                closed[filled] = candidate_closed[i];
                filled++;
            }
        }
    }
    restore_gil(released);
    PyMem_Free(scratch);
    if (filled < batch) {
        Py_DECREF(drawn);
        Py_RETURN_NONE;
    }
    return drawn;
}

/* ------------------------------------------------------------------ gathers */

static void copy_rows(char *out, const char *source, const int64_t *rows, Py_ssize_t count, Py_ssize_t row_bytes) {
    /* Fixed sizes let the compiler inline the copy (numpy's take special-cases them the same way). */
#define COPY_ROWS(SIZE)                                                                                             \
    for (Py_ssize_t i = 0; i < count; i++) memcpy(out + i * (SIZE), source + rows[i] * (SIZE), (SIZE));          \
    return;
    switch (row_bytes) {
    case 1: COPY_ROWS(1)
    case 2: COPY_ROWS(2)
    case 4: COPY_ROWS(4)
    case 8: COPY_ROWS(8)
    case 16: COPY_ROWS(16)
    case 32: COPY_ROWS(32)
    default: COPY_ROWS(row_bytes)
    }
#undef COPY_ROWS
}

/* Whether `batch` is the dict a kernel fills; TypeError otherwise. */
static int check_batch(PyObject *batch, const char *function) {
    if (PyDict_Check(batch)) return 0;
    PyErr_Format(PyExc_TypeError, "%s: expected a dict for the batch", function);
    return -1;
}

/* Whether `names` is a tuple of str; TypeError otherwise. */
static int check_names(PyObject *names) {
    if (PyTuple_Check(names)) {
        Py_ssize_t j = 0;
        /* exact str: inserting one in the batch runs no Python code (no __hash__ or __eq__ of a subclass) */
        while (j < PyTuple_GET_SIZE(names) && PyUnicode_CheckExact(PyTuple_GET_ITEM(names, j))) j++;
        if (j == PyTuple_GET_SIZE(names)) return 0;
    }
    PyErr_SetString(PyExc_TypeError, "kernel argument names: expected a tuple of str");
    return -1;
}

/* Whether `names` and `sources` are tuples of one length whose sources are arrays of at least `min_rows` rows
 * (any type and row shape); TypeError or ValueError otherwise. */
static int check_columns(PyObject *names, PyObject *sources, npy_intp min_rows) {
    if (check_names(names)) return -1;
    if (!PyTuple_Check(sources) || PyTuple_GET_SIZE(names) != PyTuple_GET_SIZE(sources)) {
        PyErr_SetString(PyExc_TypeError, "kernel arguments names and sources: expected tuples of one length");
        return -1;
    }
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(sources); j++) {
        PyArrayObject *source = array_arg(PyTuple_GET_ITEM(sources, j), "sources[j]", -1, 0, 0);
        if (!source) return -1;
        if (PyArray_NDIM(source) < 1 || PyArray_DIM(source, 0) < min_rows || PyArray_DIM(source, 0) < 1) {
            PyErr_Format(PyExc_ValueError, "kernel argument sources[%zd]: expected a column of at least %zd rows", j,
                         (Py_ssize_t)(min_rows < 1 ? 1 : min_rows));
            return -1;
        }
    }
    return 0;
}

/* The array already in batch[key] that a kernel writes its output into (a new reference), NULL with no error set
 * when there is none, or NULL with ValueError when it is not a writable, C-contiguous, aligned array of exactly
 * `ndim` dimensions `shape` and the dtype `descr`. A caller that gathers a batch straight into its destination
 * (e.g. a gRPC message, service/grpc_server/in_place.py) puts views of it in the batch before the call. */
static PyArrayObject *given_output(PyObject *batch, PyObject *key, int ndim, const npy_intp *shape,
                                   PyArray_Descr *descr) {
    PyObject *given = PyDict_GetItemWithError(batch, key);
    if (!given) return NULL;
    PyArrayObject *array = (PyArrayObject *)given;
    int fits = PyArray_Check(given) && PyArray_NDIM(array) == ndim && PyArray_ISCARRAY(array)
               && PyArray_EquivTypes(PyArray_DESCR(array), descr);
    for (int d = 0; fits && d < ndim; d++) fits = PyArray_DIM(array, d) == shape[d];
    if (!fits) {
        PyErr_Format(PyExc_ValueError, "kernel output batch[%R]: expected a writable C-contiguous array of "
                     "dtype %R and %d dimensions (%zd rows), the kernel's output", key, (PyObject *)descr, ndim,
                     (Py_ssize_t)shape[0]);
        return NULL;
    }
    Py_INCREF(given);
    return array;
}

/* batch[name] = source[rows] (rows already checked against the source's length), written into the array
 * batch[name] already holds if any (given_output). */
static int take_into(PyObject *batch, PyObject *name, PyArrayObject *source, const int64_t *rows, Py_ssize_t count) {
    npy_intp shape[NPY_MAXDIMS];
    memcpy(shape, PyArray_DIMS(source), PyArray_NDIM(source) * sizeof(npy_intp));
    shape[0] = count;
    PyArray_Descr *descr = PyArray_DESCR(source);
    PyArrayObject *taken = given_output(batch, name, PyArray_NDIM(source), shape, descr);
    int given = taken != NULL;
    if (!taken && PyErr_Occurred()) return -1;
    if (!taken) {
        Py_INCREF(descr); /* PyArray_Empty steals it */
        taken = (PyArrayObject *)PyArray_Empty(PyArray_NDIM(source), shape, descr, 0);
        if (!taken) return -1;
    }
    Py_ssize_t row_bytes = PyArray_NBYTES(source) / PyArray_DIM(source, 0);
    if (count * row_bytes > RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        copy_rows(PyArray_DATA(taken), PyArray_DATA(source), rows, count, row_bytes);
        Py_END_ALLOW_THREADS
    } else {
        copy_rows(PyArray_DATA(taken), PyArray_DATA(source), rows, count, row_bytes);
    }
    int failed = given ? 0 : PyDict_SetItem(batch, name, (PyObject *)taken);
    Py_DECREF(taken);
    return failed;
}

/* A private copy of `rows`, every one checked to be in 0..length-1 (IndexError otherwise), or NULL with the
 * error set; PyMem_Free it. Later reads, some with the GIL released, cannot see another thread change the
 * caller's array after the check. */
static int64_t *checked_rows(PyArrayObject *rows_view, npy_intp length, const char *function, const char *what) {
    Py_ssize_t count = items(rows_view);
    const int64_t *rows = PyArray_DATA(rows_view);
    int64_t *copy = PyMem_Malloc(sizeof(int64_t) * count + 1);
    if (!copy) return (int64_t *)PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < count; i++) {
        copy[i] = rows[i];
        if (copy[i] < 0 || copy[i] >= length) {
            PyErr_Format(PyExc_IndexError, "%s: row %lld is off %s of %zd rows", function, (long long)copy[i], what,
                         (Py_ssize_t)length);
            PyMem_Free(copy);
            return NULL;
        }
    }
    return copy;
}

/* batch[names[j]] = sources[j][rows] for the first `columns` columns. */
static int take_columns(PyObject *batch, PyObject *names, PyObject *sources, Py_ssize_t columns, const int64_t *rows,
                        Py_ssize_t count) {
    for (Py_ssize_t j = 0; j < columns; j++)
        if (take_into(batch, PyTuple_GET_ITEM(names, j), (PyArrayObject *)PyTuple_GET_ITEM(sources, j), rows, count))
            return -1;
    return 0;
}

/* take_rows(batch, names, rows, sources): batch[names[j]] = sources[j][rows] for every column j, in one call.
 * `sources` are whole ring columns of any type and row shape (first axis: the ring's rows). Rows off a
 * column raise IndexError (and `batch` is left as it was). Here and in the batch modes, a column already in
 * `batch` is the array to write into (given_output). */
static PyObject *take_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    PyArrayObject *rows_view;
    if (check_nargs("take_rows", nargs, 4) || !(rows_view = array_arg(args[2], "rows", NPY_INT64, 0, 0))) return NULL;
    PyObject *batch = args[0], *names = args[1], *sources = args[3];
    if (check_batch(batch, "take_rows")) return NULL;
    if (check_columns(names, sources, 0)) return NULL;
    Py_ssize_t count = items(rows_view), columns = PyTuple_GET_SIZE(sources);
    npy_intp shortest = NPY_MAX_INTP;
    for (Py_ssize_t j = 0; j < columns; j++) {
        npy_intp length = PyArray_DIM((PyArrayObject *)PyTuple_GET_ITEM(sources, j), 0);
        shortest = length < shortest ? length : shortest;
    }
    int64_t *rows = checked_rows(rows_view, shortest, "take_rows", "a column");
    if (!rows) return NULL;
    int failed = take_columns(batch, names, sources, columns, rows, count);
    PyMem_Free(rows);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ batch modes */

static PyObject *TERMINATED_KEY, *TRUNCATED_KEY, *N_STEP_RETURN_KEY, *BOOTSTRAP_DISCOUNT_KEY, *OFFSET_KEY, *MASK_KEY,
    *IS_FIRST_KEY, *BOOTSTRAP_STEP_KEY;

/* The 1-d output of `count` items of `type` for batch[key]: the array already there (given_output), or a new one;
 * NULL with the error set. */
static PyArrayObject *new_vector(PyObject *batch, PyObject *key, Py_ssize_t count, int type) {
    npy_intp shape[1] = {count};
    PyArray_Descr *descr = PyArray_DescrFromType(type);
    if (!descr) return NULL;
    PyArrayObject *given = given_output(batch, key, 1, shape, descr);
    Py_DECREF(descr);
    if (given || PyErr_Occurred()) return given;
    return (PyArrayObject *)PyArray_SimpleNew(1, shape, type);
}

/* batch[key] = array, giving up the reference to array. */
static int put(PyObject *batch, PyObject *key, PyArrayObject *array) {
    if (!array) return -1;
    int failed = PyDict_SetItem(batch, key, (PyObject *)array);
    Py_DECREF(array);
    return failed;
}

/* transition_batch(batch, positions, rows, bounds, closed, n_step, powers, capacity, reward, row_seq, extent_flags,
 *                  extent_slots, names, sources, next_names, bootstrap_names)
 *
 * Fills `batch` with a transitions batch, in this order: names[j] = sources[j][rows] (the observation fields
 * first, then the step fields); next_names[j] = sources[j][rows + 1] for the observation fields (the first
 * len(next_names) sources); terminated, truncated (1-step); and with a reward column: n_step_return,
 * bootstrap_discount, and bootstrap_names[j] = the observation at t + n_eff (the next observation's array
 * itself when n_step is 1). See TransitionsMode for the targets' definitions. `reward` is the reward column
 * (empty: the buffer has none). */
static PyObject *transition_batch(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    PyArrayObject *positions_view, *rows_view, *bounds_view, *closed_view, *powers_view, *reward_view, *row_seq_view,
        *flags_table_view;
    int64_t n_step, capacity, extent_slots;
    if (check_nargs("transition_batch", nargs, 16)) return NULL;
    PyObject *batch = args[0], *names = args[12], *sources = args[13], *next_names = args[14],
             *bootstrap_names = args[15];
    if (check_batch(batch, "transition_batch")) return NULL;
    if (!(positions_view = array_arg(args[1], "positions", NPY_INT64, 0, 0))) return NULL;
    Py_ssize_t count = items(positions_view);
    if (!(rows_view = array_arg(args[2], "rows", NPY_INT64, 0, count))
        || !(bounds_view = array_arg(args[3], "bounds", NPY_INT64, 0, count))
        || !(closed_view = array_arg(args[4], "closed", NPY_BOOL, 0, count)) || int_arg(args[5], "n_step", &n_step)
        || int_arg(args[7], "capacity", &capacity) || int_arg(args[11], "extent_slots", &extent_slots))
        return NULL;
    if (n_step < 1 || capacity < 1 || extent_slots < 1) {
        PyErr_SetString(PyExc_ValueError, "kernel arguments n_step, capacity and extent_slots must be >= 1");
        return NULL;
    }
    if (!(powers_view = array_arg(args[6], "powers", NPY_FLOAT64, 0, 1)))
        return NULL;
    if (n_step > items(powers_view) - 1) {
        PyErr_Format(PyExc_ValueError, "kernel argument powers: expected n_step + 1 = %lld items, got %zd",
                     (long long)n_step + 1, items(powers_view));
        return NULL;
    }
    if (!(reward_view = array_arg(args[8], "reward", -1, 0, 0))
        || !(row_seq_view = array_arg(args[9], "row_seq", NPY_INT64, 0, capacity))
        || !(flags_table_view = array_arg(args[10], "extent_flags", NPY_UINT8, 0, extent_slots))
        || check_columns(names, sources, capacity) || check_names(next_names)
        || (items(reward_view) > 0 && check_names(bootstrap_names)))
        return NULL;
    int has_reward = items(reward_view) > 0, reward_type = PyArray_TYPE(reward_view);
    Py_ssize_t observations = PyTuple_GET_SIZE(next_names);
    if (has_reward && ((reward_type != NPY_FLOAT32 && reward_type != NPY_FLOAT64) || items(reward_view) < capacity)) {
        PyErr_Format(PyExc_TypeError, "kernel argument reward: expected no items, or >= %lld float32 or float64",
                     (long long)capacity);
        return NULL;
    }
    if (observations > PyTuple_GET_SIZE(names) || (has_reward && PyTuple_GET_SIZE(bootstrap_names) != observations)) {
        PyErr_SetString(PyExc_ValueError,
                        "kernel arguments next_names and bootstrap_names: one name per observation field");
        return NULL;
    }
    const int64_t *positions = PyArray_DATA(positions_view), *bounds = PyArray_DATA(bounds_view),
                  *row_seq = PyArray_DATA(row_seq_view);
    int64_t *rows = checked_rows(rows_view, capacity, "transition_batch", "the ring");
    if (!rows) return NULL;
    const char *closed = PyArray_DATA(closed_view);
    const uint8_t *extent_flags = PyArray_DATA(flags_table_view);
    const double *powers = PyArray_DATA(powers_view);
    const float *reward32 = has_reward && reward_type == NPY_FLOAT32 ? PyArray_DATA(reward_view) : NULL;
    const double *reward64 = has_reward && reward_type == NPY_FLOAT64 ? PyArray_DATA(reward_view) : NULL;
#define REWARD(row) (reward32 ? (double)reward32[row] : reward64[row])

    if (take_columns(batch, names, sources, PyTuple_GET_SIZE(names), rows, count)) {
        PyMem_Free(rows);
        return NULL;
    }
    PyArrayObject *terminated_array = new_vector(batch, TERMINATED_KEY, count, NPY_BOOL),
                  *truncated_array = terminated_array ? new_vector(batch, TRUNCATED_KEY, count, NPY_BOOL) : NULL,
                  *return_array = has_reward && truncated_array
                                      ? new_vector(batch, N_STEP_RETURN_KEY, count, NPY_FLOAT32) : NULL,
                  *discount_array = return_array ? new_vector(batch, BOOTSTRAP_DISCOUNT_KEY, count, NPY_FLOAT32)
                                                 : NULL;
    int64_t *scratch = PyMem_Malloc(sizeof(int64_t) * 2 * count + sizeof(double) * count + 1);
    if (!terminated_array || !truncated_array || (has_reward && (!return_array || !discount_array)) || !scratch) {
        Py_XDECREF(terminated_array);
        Py_XDECREF(truncated_array);
        Py_XDECREF(return_array);
        Py_XDECREF(discount_array);
        PyMem_Free(scratch);
        PyMem_Free(rows);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    int64_t *next_rows = scratch, *bootstrap_rows = scratch + count;
    double *first_reward = (double *)(scratch + 2 * count);
    char *terminated = PyArray_DATA(terminated_array), *truncated = PyArray_DATA(truncated_array);
    float *n_step_return = has_reward ? PyArray_DATA(return_array) : NULL,
          *bootstrap_discount = has_reward ? PyArray_DATA(discount_array) : NULL;
    PyThreadState *released = release_gil_if(count * n_step > RELEASE_GIL_SAMPLES);
    if (has_reward) /* the random reads alone: a tight loop keeps many cache misses in flight */
        for (Py_ssize_t i = 0; i < count; i++) first_reward[i] = REWARD(rows[i]);
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t position = positions[i], row = rows[i], left = bounds[i] - position;
        /* A position at or past its bound is no step (a torn or hole bound a reader will redraw); 0 keeps the
           reads below on the ring and in `powers`. */
        int64_t n_eff = left < n_step ? left : n_step;
        if (n_eff < 0) n_eff = 0;
        next_rows[i] = wrap(row + 1, capacity);
        bootstrap_rows[i] = wrap(row + n_eff, capacity);
        /* Only a window that reaches a closed episode's final row can see its termination. */
        int episode_terminated = 0;
        if (closed[i] && bounds[i] == position + n_eff) {
            int64_t slot = row_seq[row] % extent_slots;
            episode_terminated = (extent_flags[slot < 0 ? slot + extent_slots : slot] & TERMINATED) != 0;
        }
        int last_step = closed[i] && bounds[i] == position + 1; /* the 1-step transition ends the episode */
        terminated[i] = last_step && episode_terminated;
        truncated[i] = last_step && !episode_terminated;
        if (has_reward) {
            double total = n_eff > 0 ? first_reward[i] : 0.0; /* powers[0] = 1 */
            for (int64_t k = 1; k < n_eff; k++) total += powers[k] * REWARD(wrap(row + k, capacity));
            n_step_return[i] = (float)total;
            bootstrap_discount[i] = episode_terminated ? 0.0f : (float)powers[n_eff];
        }
    }
#undef REWARD
    restore_gil(released);
    /* put gives up its array; one not put (a failure before it) is released below */
    int failed = take_columns(batch, next_names, sources, observations, next_rows, count);
    if (!failed) {
        failed = put(batch, TERMINATED_KEY, terminated_array);
        terminated_array = NULL;
    }
    if (!failed) {
        failed = put(batch, TRUNCATED_KEY, truncated_array);
        truncated_array = NULL;
    }
    if (!failed && has_reward) {
        failed = put(batch, N_STEP_RETURN_KEY, return_array);
        return_array = NULL;
        if (!failed) {
            failed = put(batch, BOOTSTRAP_DISCOUNT_KEY, discount_array);
            discount_array = NULL;
        }
        for (Py_ssize_t j = 0; !failed && n_step == 1 && j < observations; j++) { /* t + n_eff is t + 1 */
            PyObject *next = PyDict_GetItemWithError(batch, PyTuple_GET_ITEM(next_names, j));
            failed = !next || PyDict_SetItem(batch, PyTuple_GET_ITEM(bootstrap_names, j), next);
        }
        if (!failed && n_step > 1)
            failed = take_columns(batch, bootstrap_names, sources, observations, bootstrap_rows, count);
    }
    Py_XDECREF(terminated_array);
    Py_XDECREF(truncated_array);
    Py_XDECREF(return_array);
    Py_XDECREF(discount_array);
    PyMem_Free(scratch);
    PyMem_Free(rows);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

/* geometric_batch(batch, bit_generator, discount, positions, rows, bounds, capacity, names, future_names, sources)
 *
 * Fills `batch` with geometric pairs: names[j] = sources[j][rows], future_names[j] = sources[j][rows + d], and
 * offset = d, where d in 1..M has P(d) proportional to discount^(d-1), M = bound - position. The caller holds
 * the bit generator's lock.
 *
 * From E ~ Exp(1) (one per sample: the draws of Generator.standard_exponential(count)), K = floor(E / -ln g) is
 * geometric on 0, 1, ... with P(K = k) = (1 - g) g^k, and K mod M follows that law truncated to 0..M-1,
 * because P(K mod M = j) = sum_m (1 - g) g^(j + mM) is proportional to g^j. So d = 1 + (K mod M): no logarithm
 * per sample (numpy's ziggurat draws E faster than a uniform's log). g = 1 is uniform on 1..M, with
 * 1 - exp(-E) ~ U[0, 1).
 *
 * The loop that draws E also prefetches the rows it will copy: the generator's work overlaps their misses. */
static PyObject *geometric_batch(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    PyArrayObject *positions_view, *rows_view, *bounds_view;
    bitgen_t *bit_generator;
    int64_t capacity;
    if (check_nargs("geometric_batch", nargs, 10)) return NULL;
    PyObject *batch = args[0], *names = args[7], *future_names = args[8], *sources = args[9];
    if (check_batch(batch, "geometric_batch") || !(bit_generator = bit_generator_arg(args[1]))) return NULL;
    if (!(positions_view = array_arg(args[3], "positions", NPY_INT64, 0, 0))) return NULL;
    Py_ssize_t count = items(positions_view);
    double discount = PyFloat_AsDouble(args[2]);
    if (discount == -1.0 && PyErr_Occurred()) return NULL;
    if (!(rows_view = array_arg(args[4], "rows", NPY_INT64, 0, count))
        || !(bounds_view = array_arg(args[5], "bounds", NPY_INT64, 0, count))
        || int_arg(args[6], "capacity", &capacity))
        return NULL;
    if (capacity < 1 || !(discount >= 0.0 && discount <= 1.0)) {
        PyErr_SetString(PyExc_ValueError, "kernel arguments: capacity must be >= 1, discount in [0, 1]");
        return NULL;
    }
    if (check_columns(names, sources, capacity) || check_names(future_names)) return NULL;
    if (PyTuple_GET_SIZE(future_names) != PyTuple_GET_SIZE(names)) {
        PyErr_SetString(PyExc_ValueError, "kernel argument future_names: one name per source");
        return NULL;
    }
    /* The first columns' rows are prefetched (a hint: with more columns, the rest are read without it). */
    const char *prefetched[PREFETCH_COLUMNS];
    Py_ssize_t prefetched_row_bytes[PREFETCH_COLUMNS], columns = PyTuple_GET_SIZE(names);
    int prefetched_columns = columns < PREFETCH_COLUMNS ? (int)columns : PREFETCH_COLUMNS;
    for (int j = 0; j < prefetched_columns; j++) {
        PyArrayObject *source = (PyArrayObject *)PyTuple_GET_ITEM(sources, j);
        prefetched[j] = PyArray_DATA(source);
        prefetched_row_bytes[j] = PyArray_NBYTES(source) / PyArray_DIM(source, 0);
    }
    const int64_t *positions = PyArray_DATA(positions_view), *bounds = PyArray_DATA(bounds_view);
    int64_t *rows = checked_rows(rows_view, capacity, "geometric_batch", "the ring");
    if (!rows) return NULL;
    PyArrayObject *offset_array = new_vector(batch, OFFSET_KEY, count, NPY_INT64);
    int64_t *future_rows = offset_array ? PyMem_Malloc(sizeof(int64_t) * count + 1) : NULL;
    if (!future_rows) {
        Py_XDECREF(offset_array);
        PyMem_Free(rows);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    int64_t *offsets = PyArray_DATA(offset_array);
    double scale = (discount > 0.0 && discount < 1.0) ? -1.0 / log(discount) : 0.0; /* 1 / lambda */
    PyThreadState *released = release_gil_if(count > RELEASE_GIL_SAMPLES);
    for (Py_ssize_t i = 0; i < count; i++) {
        for (int j = 0; j < prefetched_columns; j++)
            __builtin_prefetch(prefetched[j] + rows[i] * prefetched_row_bytes[j]);
        double exponential = random_standard_exponential(bit_generator); /* drawn for every sample, used or not */
        int64_t horizon = bounds[i] - positions[i], offset;
        if (horizon <= 1 || discount == 0.0) {
            offset = horizon < 1 ? horizon : 1; /* below 1 only for a torn read, which the reader discards */
        } else if (discount == 1.0) {
            offset = (int64_t)(-expm1(-exponential) * (double)horizon);
            offset = (offset < horizon - 1 ? offset : horizon - 1) + 1;
        } else {
            /* K mod M. Below 2^53 the remainder is computed exactly from a double quotient (an integer division
               costs ~40 cycles here), mended with conditional moves: whether K reaches M is a coin flip, which a
               branch would mispredict. fmod, exact too but slow, takes the rest (astronomically rare: a
               discount within ~1e-14 of 1). */
            double scaled = exponential * scale;
            if (scaled < 9007199254740992.0) {
                int64_t k = (int64_t)scaled; /* floor: scaled >= 0 */
                k -= horizon * (int64_t)((double)k / (double)horizon); /* the quotient may be one off: mended */
                k += k < 0 ? horizon : 0;
                k -= k >= horizon ? horizon : 0;
                offset = k + 1;
            } else {
                offset = (int64_t)fmod(floor(scaled), (double)horizon) + 1;
            }
        }
        offsets[i] = offset;
        future_rows[i] = wrap(rows[i] + offset, capacity);
        for (int j = 0; j < prefetched_columns; j++)
            __builtin_prefetch(prefetched[j] + future_rows[i] * prefetched_row_bytes[j]);
    }
    restore_gil(released);
    int failed = take_columns(batch, names, sources, columns, rows, count)
                 || take_columns(batch, future_names, sources, columns, future_rows, count);
    if (failed)
        Py_DECREF(offset_array);
    else
        failed = put(batch, OFFSET_KEY, offset_array); /* gives up offset_array */
    PyMem_Free(future_rows);
    PyMem_Free(rows);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

/* The (count, steps) output of `type` for batch[key], as new_vector makes 1-d ones; NULL with the error set. */
static PyArrayObject *new_matrix(PyObject *batch, PyObject *key, Py_ssize_t count, Py_ssize_t steps, int type) {
    npy_intp shape[2] = {count, steps};
    PyArray_Descr *descr = PyArray_DescrFromType(type);
    if (!descr) return NULL;
    PyArrayObject *given = given_output(batch, key, 2, shape, descr);
    Py_DECREF(descr);
    if (given || PyErr_Occurred()) return given;
    return (PyArrayObject *)PyArray_SimpleNew(2, shape, type);
}

/* batch[name] = the `steps` rows of `source` from each ring row of `rows`, `held[i]` of them read (wrapping
 * round the ring's end: two copies) and the rest zeros: a (count, steps, *row) array, written into the one
 * batch[name] holds if any (given_output). */
/* take_sequences prefetches the first PREFETCH_BYTES of the sequence SEQUENCE_PREFETCH ahead of the one it
 * copies: each sequence starts at a random row, a cache (and, on large rings, TLB) miss that the copies of the
 * sequences before it then hide; the hardware prefetcher streams the rest of each sequence. */
#define SEQUENCE_PREFETCH 2
#define PREFETCH_BYTES 256

static int take_sequences(PyObject *batch, PyObject *name, PyArrayObject *source, const int64_t *rows,
                          const int64_t *held, Py_ssize_t count, Py_ssize_t steps, int64_t capacity) {
    npy_intp shape[NPY_MAXDIMS];
    int ndim = PyArray_NDIM(source) + 1;
    shape[0] = count;
    shape[1] = steps;
    memcpy(shape + 2, PyArray_DIMS(source) + 1, (ndim - 2) * sizeof(npy_intp));
    PyArray_Descr *descr = PyArray_DESCR(source);
    PyArrayObject *taken = given_output(batch, name, ndim, shape, descr);
    int given = taken != NULL;
    if (!taken && PyErr_Occurred()) return -1;
    if (!taken) {
        Py_INCREF(descr); /* PyArray_Empty steals it */
        taken = (PyArrayObject *)PyArray_Empty(ndim, shape, descr, 0);
        if (!taken) return -1;
    }
    Py_ssize_t row_bytes = PyArray_NBYTES(source) / PyArray_DIM(source, 0);
    char *out = PyArray_DATA(taken);
    const char *from = PyArray_DATA(source);
    PyThreadState *released = release_gil_if(count * steps * row_bytes > RELEASE_GIL_BYTES);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i + SEQUENCE_PREFETCH < count) /* the start of a sequence ahead: its miss overlaps these copies */
            for (Py_ssize_t b = 0; b < PREFETCH_BYTES && b < held[i + SEQUENCE_PREFETCH] * row_bytes; b += 64)
                __builtin_prefetch(from + rows[i + SEQUENCE_PREFETCH] * row_bytes + b);
        char *sequence = out + i * steps * row_bytes;
        int64_t first = capacity - rows[i] < held[i] ? capacity - rows[i] : held[i]; /* rows before the ring's end */
        memcpy(sequence, from + rows[i] * row_bytes, first * row_bytes);
        memcpy(sequence + first * row_bytes, from, (held[i] - first) * row_bytes);
        memset(sequence + held[i] * row_bytes, 0, (steps - held[i]) * row_bytes);
    }
    restore_gil(released);
    int failed = given ? 0 : PyDict_SetItem(batch, name, (PyObject *)taken);
    Py_DECREF(taken);
    return failed;
}

/* Per-sequence inputs of sequence_flags and sequence_targets. */
typedef struct {
    const int64_t *positions, *rows, *bounds, *starts, *held;
    const char *closed, *ended;
    Py_ssize_t count, steps;
    int64_t capacity;
} Sequences;

/* Rows of sequence i that are steps (have a successor in the episode): those before its bound. */
static inline int64_t sequence_steps(const Sequences *q, Py_ssize_t i) {
    int64_t left = q->bounds[i] - q->positions[i];
    return left < 0 ? 0 : left > q->steps ? q->steps : left;
}

/* mask, is_first, terminated, truncated of every row of every sequence. */
static void sequence_flags(const Sequences *q, char *mask, char *is_first, char *terminated, char *truncated) {
    memset(is_first, 0, q->count * q->steps);
    memset(terminated, 0, q->count * q->steps);
    memset(truncated, 0, q->count * q->steps);
    for (Py_ssize_t i = 0; i < q->count; i++) {
        Py_ssize_t row = i * q->steps, steps = sequence_steps(q, i);
        memset(mask + row, 1, steps);
        memset(mask + row + steps, 0, q->steps - steps);
        int64_t first = q->starts[i] - q->positions[i]; /* where the episode's first row lies, if within */
        if (first >= 0 && first < q->held[i]) is_first[row + first] = 1;
        int64_t last = q->bounds[i] - q->positions[i] - 1; /* the step whose transition ends the episode */
        if (q->closed[i] && last >= 0 && last < steps) {
            terminated[row + last] = q->ended[i];
            truncated[row + last] = !q->ended[i];
        }
    }
}

/* Each step's n-step return, bootstrap discount and bootstrap row within its sequence (TransitionsMode's
 * targets); zeros where a row is no step. `window` holds 2 * steps + n_step - 1 doubles: a sequence's rewards
 * are read once into it, zeros past its episode's last step (so every window sums n_step terms), and the
 * returns are summed there term by term across the sequence (independent sums the compiler vectorizes). */
static void sequence_targets(const Sequences *q, int64_t n_step, const double *powers, const float *reward32,
                             const double *reward64, double *window, float *returns, float *discounts,
                             int32_t *bootstrap_steps) {
    Py_ssize_t T = q->steps;
    double *total = window + T + n_step - 1;
    for (Py_ssize_t i = 0; i < q->count; i++) {
        int64_t steps = sequence_steps(q, i), left = q->bounds[i] - q->positions[i];
        int64_t rewards = steps + n_step - 1 < left ? steps + n_step - 1 : left; /* those of the episode's steps */
        for (int64_t k = 0; k < rewards; k++) {
            int64_t row = wrap(q->rows[i] + k, q->capacity);
            window[k] = reward32 ? (double)reward32[row] : reward64[row];
        }
        for (int64_t k = rewards < 0 ? 0 : rewards; k < T + n_step - 1; k++) window[k] = 0.0;
        for (Py_ssize_t t = 0; t < T; t++) total[t] = 0.0;
        for (int64_t k = 0; k < n_step; k++)
            for (Py_ssize_t t = 0; t < steps; t++) total[t] += powers[k] * window[t + k];
        for (Py_ssize_t t = 0; t < T; t++) {
            Py_ssize_t at = i * T + t;
            int64_t n_eff = left - t < n_step ? left - t : n_step;
            int step = t < steps;
            returns[at] = step ? (float)total[t] : 0.0f;
            discounts[at] = !step || (q->ended[i] && t + n_eff == left) ? 0.0f : (float)powers[n_eff];
            bootstrap_steps[at] = step ? (int32_t)(t + n_eff) : 0;
        }
    }
}

/* The extent tables a batch mode reads its episodes' starts and ends from. */
typedef struct {
    const int64_t *row_seq, *extent_start;
    const uint8_t *extent_flags;
    int64_t slots;
} Extents;

static int extents_arg(PyObject *const *args, int64_t capacity, Extents *extents) {
    PyArrayObject *row_seq, *extent_start, *extent_flags;
    if (int_arg(args[3], "extent_slots", &extents->slots)) return -1;
    if (extents->slots < 1) {
        PyErr_SetString(PyExc_ValueError, "kernel argument extent_slots: expected >= 1");
        return -1;
    }
    if (!(row_seq = array_arg(args[0], "row_seq", NPY_INT64, 0, capacity))
        || !(extent_start = array_arg(args[1], "extent_start", NPY_INT64, 0, extents->slots))
        || !(extent_flags = array_arg(args[2], "extent_flags", NPY_UINT8, 0, extents->slots)))
        return -1;
    extents->row_seq = PyArray_DATA(row_seq);
    extents->extent_start = PyArray_DATA(extent_start);
    extents->extent_flags = PyArray_DATA(extent_flags);
    return 0;
}

/* The extent-table slot of a drawn row: its open episode's (open_seq, read with the draw), else its row's. */
static inline int64_t extent_slot(const Extents *e, int64_t row, int64_t open_seq) {
    int64_t slot = (open_seq >= 0 ? open_seq : e->row_seq[row]) % e->slots;
    return slot < 0 ? slot + e->slots : slot;
}

/* Checks sequence_batch's per-sequence arrays and fills q (rows and held: PyMem_Free them); -1 with the error
 * set. `args` from positions on: positions, rows, bounds, closed, open_seq, steps, capacity, row_seq,
 * extent_start, extent_flags, extent_slots. */
static int sequences_arg(PyObject *const *args, Sequences *q) {
    PyArrayObject *positions_view, *rows_view, *bounds_view, *closed_view, *open_seq_view;
    Extents extents;
    int64_t steps;
    if (!(positions_view = array_arg(args[0], "positions", NPY_INT64, 0, 0))) return -1;
    q->count = items(positions_view);
    if (!(rows_view = array_arg(args[1], "rows", NPY_INT64, 0, q->count))
        || !(bounds_view = array_arg(args[2], "bounds", NPY_INT64, 0, q->count))
        || !(closed_view = array_arg(args[3], "closed", NPY_BOOL, 0, q->count))
        || !(open_seq_view = array_arg(args[4], "open_seq", NPY_INT64, 0, q->count))
        || int_arg(args[5], "steps", &steps) || int_arg(args[6], "capacity", &q->capacity))
        return -1;
    if (q->capacity < 1 || steps < 1 || steps > q->capacity) {
        PyErr_SetString(PyExc_ValueError, "kernel arguments: capacity >= 1 and steps in 1..capacity expected");
        return -1;
    }
    if (extents_arg(args + 7, q->capacity, &extents)) return -1;
    q->steps = (Py_ssize_t)steps;
    q->positions = PyArray_DATA(positions_view);
    q->bounds = PyArray_DATA(bounds_view);
    q->closed = PyArray_DATA(closed_view);
    const int64_t *open_seq = PyArray_DATA(open_seq_view);
    int64_t *rows = checked_rows(rows_view, q->capacity, "sequence_batch", "the ring");
    int64_t *held = rows ? PyMem_Malloc((2 * sizeof(int64_t) + 1) * q->count + 1) : NULL;
    if (!held) {
        PyMem_Free(rows);
        return PyErr_Occurred() ? -1 : (PyErr_NoMemory(), -1);
    }
    int64_t *starts = held + q->count;
    char *ended = (char *)(starts + q->count);
    for (Py_ssize_t i = 0; i < q->count; i++) {
        if (i + SEQUENCE_PREFETCH < q->count) __builtin_prefetch(extents.row_seq + rows[i + SEQUENCE_PREFETCH]);
        int64_t rows_left = q->bounds[i] - q->positions[i] + 1; /* < 1 only for a torn read, discarded later */
        held[i] = rows_left < 0 ? 0 : rows_left > steps ? steps : rows_left; /* the final observation included */
        int64_t slot = extent_slot(&extents, rows[i], open_seq[i]);
        starts[i] = extents.extent_start[slot];
        ended[i] = q->closed[i] && (extents.extent_flags[slot] & TERMINATED) != 0;
    }
    q->rows = rows;
    q->held = held;
    q->starts = starts;
    q->ended = ended;
    return 0;
}

/* Puts sequence_batch's n-step targets in `batch`; -1 with the error set. */
static int put_sequence_targets(PyObject *batch, const Sequences *q, int64_t n_step, PyObject *powers_arg,
                                PyObject *reward_arg) {
    PyArrayObject *powers_view = array_arg(powers_arg, "powers", NPY_FLOAT64, 0, n_step + 1);
    PyArrayObject *reward_view = powers_view ? array_arg(reward_arg, "reward", -1, 0, q->capacity) : NULL;
    if (!reward_view) return -1;
    int type = PyArray_TYPE(reward_view);
    if (type != NPY_FLOAT32 && type != NPY_FLOAT64) {
        PyErr_SetString(PyExc_TypeError, "kernel argument reward: expected float32 or float64 items");
        return -1;
    }
    PyArrayObject *returns = new_matrix(batch, N_STEP_RETURN_KEY, q->count, q->steps, NPY_FLOAT32),
                  *discounts = returns ? new_matrix(batch, BOOTSTRAP_DISCOUNT_KEY, q->count, q->steps, NPY_FLOAT32)
                                       : NULL,
                  *bootstrap_steps = discounts ? new_matrix(batch, BOOTSTRAP_STEP_KEY, q->count, q->steps, NPY_INT32)
                                               : NULL;
    if (!bootstrap_steps) {
        Py_XDECREF(returns);
        Py_XDECREF(discounts);
        return -1;
    }
    double *window = PyMem_Malloc(sizeof(double) * (2 * q->steps + n_step));
    if (!window) {
        Py_DECREF(returns);
        Py_DECREF(discounts);
        Py_DECREF(bootstrap_steps);
        PyErr_NoMemory();
        return -1;
    }
    sequence_targets(q, n_step, PyArray_DATA(powers_view), type == NPY_FLOAT32 ? PyArray_DATA(reward_view) : NULL,
                     type == NPY_FLOAT64 ? PyArray_DATA(reward_view) : NULL, window, PyArray_DATA(returns),
                     PyArray_DATA(discounts), PyArray_DATA(bootstrap_steps));
    PyMem_Free(window);
    int failed = put(batch, N_STEP_RETURN_KEY, returns);
    failed = put(batch, BOOTSTRAP_DISCOUNT_KEY, discounts) || failed;
    return put(batch, BOOTSTRAP_STEP_KEY, bootstrap_steps) || failed;
}

/* sequence_batch(batch, positions, rows, bounds, closed, open_seq, steps, capacity, row_seq, extent_start,
 *                extent_flags, extent_slots, names, sources, n_step, powers, reward)
 *
 * Fills `batch` with sequences of `steps` rows from each drawn position (a Draw's arrays), never past its
 * episode's final row (bounds): names[j] = sources[j] over those rows, zeros after the episode's final
 * observation, (count, steps, *row); mask, is_first, terminated, truncated (count, steps); and with n_step >= 1,
 * n_step_return, bootstrap_discount (float32) and bootstrap_step (int32). See SequencesMode. */
static PyObject *sequence_batch(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Sequences q;
    int64_t n_step;
    if (check_nargs("sequence_batch", nargs, 17) || check_batch(args[0], "sequence_batch")) return NULL;
    PyObject *batch = args[0], *names = args[12], *sources = args[13];
    if (int_arg(args[14], "n_step", &n_step) || sequences_arg(args + 1, &q)) return NULL;
    int failed = n_step < 0 || check_columns(names, sources, q.capacity);
    if (n_step < 0) PyErr_SetString(PyExc_ValueError, "kernel argument n_step: expected >= 0");
    for (Py_ssize_t j = 0; !failed && j < PyTuple_GET_SIZE(names); j++)
        failed = take_sequences(batch, PyTuple_GET_ITEM(names, j), (PyArrayObject *)PyTuple_GET_ITEM(sources, j),
                                q.rows, q.held, q.count, q.steps, q.capacity);
    PyObject *keys[4] = {MASK_KEY, IS_FIRST_KEY, TERMINATED_KEY, TRUNCATED_KEY};
    PyArrayObject *flags[4] = {NULL, NULL, NULL, NULL};
    for (int k = 0; !failed && k < 4; k++)
        failed = !(flags[k] = new_matrix(batch, keys[k], q.count, q.steps, NPY_BOOL));
    if (!failed) {
        sequence_flags(&q, PyArray_DATA(flags[0]), PyArray_DATA(flags[1]), PyArray_DATA(flags[2]),
                       PyArray_DATA(flags[3]));
        for (int k = 0; k < 4; k++) {
            failed = put(batch, keys[k], flags[k]) || failed;
            flags[k] = NULL;
        }
    }
    for (int k = 0; k < 4; k++) Py_XDECREF(flags[k]);
    if (!failed && n_step > 0) failed = put_sequence_targets(batch, &q, n_step, args[15], args[16]);
    PyMem_Free((void *)q.rows);
    PyMem_Free((void *)q.held);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

/* hindsight_goals(goal, achieved, bit_generator, strategy, relabel_ratio, discount, positions, rows, bounds,
 *                 open_seq, capacity, row_seq, extent_start, extent_flags, extent_slots) -> (relabeled, goal_offset)
 *
 * Relabels the batch's desired goals (`goal`, (count, *goal) gathered at a Draw's `rows`) in place: with
 * probability relabel_ratio a draw's goal becomes achieved[row + k], the goal achieved k steps later in its
 * episode, k by the strategy (0 final, 1 future, 2 episode, 3 geometric with `discount`; see HindsightMode). Two
 * uniforms per draw, in draw order: whether to relabel, then k (both drawn for every draw). The caller holds the
 * bit generator's lock. */
static int64_t hindsight_offset(int strategy, double uniform, int64_t left, int64_t before, double discount) {
    if (left < 1) return left < 0 ? 0 : left; /* a torn read, discarded later */
    switch (strategy) {
    case 0: return left;
    case 1: return 1 + (int64_t)fmin(uniform * (double)left, (double)(left - 1));
    case 2: return (int64_t)fmin(uniform * (double)(before + left + 1), (double)(before + left)) - before;
    default:
        if (discount == 0.0 || left == 1) return 1;
        if (discount == 1.0) return 1 + (int64_t)fmin(uniform * (double)left, (double)(left - 1));
        { /* F(k) = (1 - g^k) / (1 - g^M), inverted */
            double log_g = log(discount), k = floor(log1p(-uniform * -expm1((double)left * log_g)) / log_g) + 1;
            return k < 1 ? 1 : k > left ? left : (int64_t)k;
        }
    }
}

static PyObject *hindsight_goals(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    PyArrayObject *goal, *achieved, *positions_view, *rows_view, *bounds_view, *open_seq_view;
    bitgen_t *bit_generator;
    Extents extents;
    int64_t strategy, capacity;
    if (check_nargs("hindsight_goals", nargs, 15) || !(goal = array_arg(args[0], "goal", -1, 1, 0))
        || !(achieved = array_arg(args[1], "achieved", -1, 0, 0)) || !(bit_generator = bit_generator_arg(args[2]))
        || int_arg(args[3], "strategy", &strategy)
        || !(positions_view = array_arg(args[6], "positions", NPY_INT64, 0, 0))
        || int_arg(args[10], "capacity", &capacity))
        return NULL;
    Py_ssize_t count = items(positions_view);
    double ratio = PyFloat_AsDouble(args[4]), discount = PyFloat_AsDouble(args[5]);
    if (PyErr_Occurred() || !(rows_view = array_arg(args[7], "rows", NPY_INT64, 0, count))
        || !(bounds_view = array_arg(args[8], "bounds", NPY_INT64, 0, count))
        || !(open_seq_view = array_arg(args[9], "open_seq", NPY_INT64, 0, count)) || capacity < 1
        || extents_arg(args + 11, capacity, &extents))
        return NULL;
    Py_ssize_t row_bytes = PyArray_NDIM(achieved) && PyArray_DIM(achieved, 0)
                               ? PyArray_NBYTES(achieved) / PyArray_DIM(achieved, 0) : 0;
    if (strategy < 0 || strategy > 3 || PyArray_NDIM(achieved) < 1 || PyArray_DIM(achieved, 0) < capacity
        || !PyArray_EquivTypes(PyArray_DESCR(goal), PyArray_DESCR(achieved)) || PyArray_NDIM(goal) < 1
        || PyArray_DIM(goal, 0) != count || PyArray_NBYTES(goal) != count * row_bytes) {
        PyErr_SetString(PyExc_ValueError, "hindsight_goals: expected strategy 0..3, an achieved column of the ring's "
                        "rows, and one goal row of its dtype and shape per draw");
        return NULL;
    }
    int64_t *rows = checked_rows(rows_view, capacity, "hindsight_goals", "the ring");
    npy_intp shape[1] = {count};
    PyArrayObject *relabeled_array = rows ? (PyArrayObject *)PyArray_SimpleNew(1, shape, NPY_BOOL) : NULL,
                  *offset_array = relabeled_array ? (PyArrayObject *)PyArray_SimpleNew(1, shape, NPY_INT64) : NULL;
    if (!offset_array) {
        Py_XDECREF(relabeled_array);
        PyMem_Free(rows);
        return NULL;
    }
    const int64_t *positions = PyArray_DATA(positions_view), *bounds = PyArray_DATA(bounds_view),
                  *open_seq = PyArray_DATA(open_seq_view);
    char *relabeled = PyArray_DATA(relabeled_array), *goals = PyArray_DATA(goal);
    const char *achieved_rows = PyArray_DATA(achieved);
    int64_t *offsets = PyArray_DATA(offset_array);
    for (Py_ssize_t i = 0; i < count; i++) {
        relabeled[i] = next_double(bit_generator) < ratio;
        int64_t start = extents.extent_start[extent_slot(&extents, rows[i], open_seq[i])];
        int64_t offset = hindsight_offset((int)strategy, next_double(bit_generator), bounds[i] - positions[i],
                                          positions[i] - start, discount);
        offsets[i] = relabeled[i] ? offset : 0;
        if (relabeled[i])
            memcpy(goals + i * row_bytes, achieved_rows + wrap(rows[i] + offset, capacity) * row_bytes, row_bytes);
    }
    PyMem_Free(rows);
    return Py_BuildValue("(NN)", relabeled_array, offset_array);
}

/* ------------------------------------------------------------------ frame stacks */

/* One item's stack of k frames (NULL: a frame of zeros), `frame_bytes` each of `itemsize`-byte elements, written
 * interleaved: element e of frame j lands at (e * k + j), the layout of a stack on the last axis. */
static void interleave_frames(char *out, const char *const *frames, Py_ssize_t k, Py_ssize_t frame_bytes,
                              Py_ssize_t itemsize) {
    Py_ssize_t elements = frame_bytes / itemsize;
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (itemsize == 1 && k == 4 && frames[0] && frames[1] && frames[2] && frames[3]) {
        /* Atari's case: four byte frames into 32-bit words, a loop the compiler vectorizes */
        const uint8_t *a = (const uint8_t *)frames[0], *b = (const uint8_t *)frames[1],
                      *c = (const uint8_t *)frames[2], *d = (const uint8_t *)frames[3];
        for (Py_ssize_t e = 0; e < elements; e++) {
            uint32_t word = (uint32_t)a[e] | (uint32_t)b[e] << 8 | (uint32_t)c[e] << 16 | (uint32_t)d[e] << 24;
            memcpy(out + 4 * e, &word, 4);
        }
        return;
    }
#endif
    for (Py_ssize_t j = 0; j < k; j++) {
        char *to = out + j * itemsize;
        if (!frames[j]) {
            for (Py_ssize_t e = 0; e < elements; e++) memset(to + e * k * itemsize, 0, itemsize);
            continue;
        }
        for (Py_ssize_t e = 0; e < elements; e++) memcpy(to + e * k * itemsize, frames[j] + e * itemsize, itemsize);
    }
}

/* stack_frames(out, source, rows, axis_first)
 *
 * Stacks frames of `source` (a column: one frame per row, any type and frame shape) into `out`, item by item:
 * item n holds the frames source[rows[n, j]] for j in 0..k-1 (rows: (N, k) int64; -1: a frame of zeros), as
 * (k, *frame) when axis_first, else (*frame, k). `out` is any writable C-contiguous array of source's dtype and
 * N * k frames' bytes (e.g. a view of the message a batch is sent in). Rows off the column raise IndexError
 * before anything is written. */
static PyObject *stack_frames(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    PyArrayObject *out, *source, *rows_view;
    int64_t axis_first;
    (void)module;
    if (check_nargs("stack_frames", nargs, 4) || !(out = array_arg(args[0], "out", -1, 1, 0))
        || !(source = array_arg(args[1], "source", -1, 0, 0)) || !(rows_view = array_arg(args[2], "rows", NPY_INT64, 0, 0))
        || int_arg(args[3], "axis_first", &axis_first))
        return NULL;
    if (PyArray_NDIM(source) < 1 || PyArray_NDIM(rows_view) != 2) {
        PyErr_SetString(PyExc_ValueError, "stack_frames: expected a source with a row axis and (N, k) rows");
        return NULL;
    }
    Py_ssize_t count = PyArray_DIM(rows_view, 0), k = PyArray_DIM(rows_view, 1), itemsize = PyArray_ITEMSIZE(source),
               frame_bytes = itemsize;
    for (int d = 1; d < PyArray_NDIM(source); d++) frame_bytes *= PyArray_DIM(source, d);
    if (!PyArray_EquivTypes(PyArray_DESCR(out), PyArray_DESCR(source)) || PyArray_NBYTES(out) != count * k * frame_bytes) {
        PyErr_Format(PyExc_ValueError, "stack_frames: out expected %zd bytes of the source's dtype, got %zd",
                     count * k * frame_bytes, (Py_ssize_t)PyArray_NBYTES(out));
        return NULL;
    }
    const int64_t *given = PyArray_DATA(rows_view);
    npy_intp length = PyArray_DIM(source, 0);
    for (Py_ssize_t i = 0; i < count * k; i++)
        if (given[i] < -1 || given[i] >= length) {
            PyErr_Format(PyExc_IndexError, "stack_frames: row %lld is off a column of %zd rows", (long long)given[i],
                         (Py_ssize_t)length);
            return NULL;
        }
    const char **frames = PyMem_Malloc(sizeof(char *) * (k + 1));
    if (!frames) return PyErr_NoMemory();
    char *to = PyArray_DATA(out);
    const char *from = PyArray_DATA(source);
    PyThreadState *released = release_gil_if(count * k * frame_bytes > RELEASE_GIL_BYTES);
    for (Py_ssize_t n = 0; n < count; n++, to += k * frame_bytes) {
        for (Py_ssize_t j = 0; j < k; j++) {
            int64_t row = given[n * k + j];
            frames[j] = row < 0 ? NULL : from + row * frame_bytes;
            if (!axis_first) continue;
            if (frames[j]) memcpy(to + j * frame_bytes, frames[j], frame_bytes);
            else memset(to + j * frame_bytes, 0, frame_bytes);
        }
        if (!axis_first) interleave_frames(to, frames, k, frame_bytes, itemsize);
    }
    restore_gil(released);
    PyMem_Free(frames);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ lock-free reader checks */

/* bounds_kept(rows, bounds, closed, row_end) -> bool
 *
 * Whether a lock-free reader's drawn rows kept the bounds the draw read, as far as its batch could have
 * seen. Call after every other read of the batch (row_end is read again here), and read the tail only after
 * this returns (a later check of the positions against it catches rows evicted and reused):
 * - a closed episode's rows keep their bound until evicted;
 * - an open episode's rows stay OPEN, or turn into holes when it moves to the head (its old rows and extent
 *   record stay as they were until evicted, and the batch took its id from the draw), or their bounds become
 *   its final row when it closes: at the last row the draw read, the draw may have read that row without
 *   knowing the episode ended (the writer sets the bounds before the last row); past it, the episode closed
 *   after the draw and the batch is what the open episode held. */
static PyObject *bounds_kept(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    PyArrayObject *rows_view, *bounds_view, *closed_view, *row_end_view;
    if (check_nargs("bounds_kept", nargs, 4) || !(rows_view = array_arg(args[0], "rows", NPY_INT64, 0, 0)))
        return NULL;
    Py_ssize_t count = items(rows_view);
    if (!(bounds_view = array_arg(args[1], "bounds", NPY_INT64, 0, count))
        || !(closed_view = array_arg(args[2], "closed", NPY_BOOL, 0, count))
        || !(row_end_view = array_arg(args[3], "row_end", NPY_INT64, 0, 1)))
        return NULL;
    const int64_t *rows = PyArray_DATA(rows_view), *bounds = PyArray_DATA(bounds_view),
                  *row_end = PyArray_DATA(row_end_view);
    const char *closed = PyArray_DATA(closed_view);
    int64_t capacity = items(row_end_view);
    int kept = 1;
    for (Py_ssize_t i = 0; i < count && kept; i++) {
        int64_t now = row_end[wrap(rows[i], capacity)];
        kept = closed[i] ? now == bounds[i] : (now == OPEN || now == HOLE || now > bounds[i]);
    }
    return PyBool_FromLong(kept);
}

/* drawn_live(positions, bounds, tail) -> bool: whether every drawn position was a step and is still live
 * (>= the tail, read after the batch). */
static PyObject *drawn_live(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    PyArrayObject *positions_view, *bounds_view;
    int64_t tail;
    if (check_nargs("drawn_live", nargs, 3)
        || !(positions_view = array_arg(args[0], "positions", NPY_INT64, 0, 0)))
        return NULL;
    Py_ssize_t count = items(positions_view);
    if (!(bounds_view = array_arg(args[1], "bounds", NPY_INT64, 0, count)) || int_arg(args[2], "tail", &tail))
        return NULL;
    const int64_t *positions = PyArray_DATA(positions_view), *bounds = PyArray_DATA(bounds_view);
    int live = 1;
    for (Py_ssize_t i = 0; i < count && live; i++) live = positions[i] >= tail && positions[i] < bounds[i];
    return PyBool_FromLong(live);
}

/* ------------------------------------------------------------------ K-ary sum tree (sum_tree.py) */

#define TREE_K 8

/* The levels of a tree (sum_tree.level_sizes): level d is [starts[d], starts[d + 1]) of the arrays. */
typedef struct {
    Py_ssize_t depth; /* levels, root included */
    const int64_t *starts;
} TreeLevels;

static int tree_levels_arg(PyObject *obj, npy_intp size, TreeLevels *levels) {
    PyArrayObject *starts = array_arg(obj, "level_starts", NPY_INT64, 0, 3);
    if (!starts) return -1;
    const int64_t *at = PyArray_DATA(starts);
    Py_ssize_t depth = items(starts) - 1;
    int ok = at[0] == 0 && at[1] == 1 && at[depth] == size;
    for (Py_ssize_t d = 2; ok && d <= depth; d++) ok = at[d] > at[d - 1] && (at[d] - at[d - 1]) % TREE_K == 0;
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "kernel argument level_starts: not the levels of a tree of this size");
        return -1;
    }
    levels->depth = depth;
    levels->starts = at;
    return 0;
}

/* tree_find(sums, level_starts, targets, out nodes int64): SumTree.find_prefix's descent. The top level is
 * searched by its running sums (targets clipped to [0, total)), each level below by the running sums of the
 * chosen node's K children, added in order as a cumulative sum adds them: the first sum past the target ends
 * at the chosen child (the last child when none is: a rounding error, or a reader mid-update). A node past
 * its level's rows (only under a parent larger than its children) reads the level's last row. Returns False
 * when every top-level node is zero. */
static PyObject *tree_find(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    PyArrayObject *sums_view, *targets_view, *out_view;
    TreeLevels levels;
    if (check_nargs("tree_find", nargs, 4) || !(sums_view = array_arg(args[0], "sums", NPY_FLOAT64, 0, 1))
        || tree_levels_arg(args[1], items(sums_view), &levels)
        || !(targets_view = array_arg(args[2], "targets", NPY_FLOAT64, 0, 0))
        || !(out_view = array_arg(args[3], "out", NPY_INT64, 1, items(targets_view))))
        return NULL;
    const double *sums = PyArray_DATA(sums_view), *targets = PyArray_DATA(targets_view);
    int64_t *out = PyArray_DATA(out_view);
    Py_ssize_t count = items(targets_view), top = levels.starts[2] - levels.starts[1];
    double *running = PyMem_Malloc(sizeof(double) * (top + 1));
    if (!running) return PyErr_NoMemory();
    const double *top_level = sums + levels.starts[1];
    running[0] = 0.0;
    for (Py_ssize_t i = 0; i < top; i++) running[i + 1] = running[i] + top_level[i];
    if (!(running[top] > 0.0)) {
        PyMem_Free(running);
        Py_RETURN_FALSE;
    }
    double highest = nextafter(running[top], 0.0);
    for (Py_ssize_t i = 0; i < count; i++) {
        double target = targets[i];
        target = target >= 0.0 ? (target <= highest ? target : highest) : 0.0; /* NaN: 0 */
        Py_ssize_t low = 0, high = top; /* the first running sum past the target: running[low + 1] */
        while (low < high) {
            Py_ssize_t middle = (low + high) / 2;
            if (running[middle + 1] > target) high = middle;
            else low = middle + 1;
        }
        int64_t node = low;
        target -= running[node];
        for (Py_ssize_t d = 2; d < levels.depth; d++) {
            int64_t rows = (levels.starts[d + 1] - levels.starts[d]) / TREE_K;
            /* A node past the rows stays past (its children too, in a tree's layout) but no further: a layout
               of many short levels would otherwise grow it K-fold per level until it wraps negative. */
            if (node > rows) node = rows;
            const double *children = sums + levels.starts[d] + TREE_K * (node < rows ? node : rows - 1);
            double before = 0.0; /* the running sum before the chosen child */
            int child = TREE_K - 1;  /* none past the target: the last child, after the sum of the others */
            for (int j = 0; j < TREE_K; j++) {
                double after = before + children[j];
                if (after > target) {
                    child = j;
                    break;
                }
                if (j < TREE_K - 1) before = after;
            }
            target -= before;
            node = node * TREE_K + child;
        }
        out[i] = node;
    }
    PyMem_Free(running);
    Py_RETURN_TRUE;
}

/* tree_update(sums, mins, level_starts, leaves int64, values float64): SumTree.update. Each leaf in turn
 * (a leaf named twice keeps its last value) is set, then every ancestor below the root is recomputed from its
 * K children (sum, and min where an empty leaf counts as +inf), so no rounding drift builds up; the root
 * last. Leaves off the leaf level raise IndexError before anything is written. */
static PyObject *tree_update(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    PyArrayObject *sums_view, *mins_view, *leaves_view, *values_view;
    TreeLevels levels;
    if (check_nargs("tree_update", nargs, 5) || !(sums_view = array_arg(args[0], "sums", NPY_FLOAT64, 1, 1))
        || !(mins_view = array_arg(args[1], "mins", NPY_FLOAT64, 1, items(sums_view)))
        || tree_levels_arg(args[2], items(sums_view), &levels)
        || !(leaves_view = array_arg(args[3], "leaves", NPY_INT64, 0, 0))
        || !(values_view = array_arg(args[4], "values", NPY_FLOAT64, 0, items(leaves_view))))
        return NULL;
    if (items(mins_view) != items(sums_view)) {
        PyErr_SetString(PyExc_ValueError, "kernel arguments sums and mins: expected one size");
        return NULL;
    }
    double *sums = PyArray_DATA(sums_view), *mins = PyArray_DATA(mins_view);
    const int64_t *leaves = PyArray_DATA(leaves_view), *starts = levels.starts;
    const double *values = PyArray_DATA(values_view);
    Py_ssize_t count = items(leaves_view), last = levels.depth - 1;
    int64_t leaf_count = starts[last + 1] - starts[last];
    for (Py_ssize_t i = 0; i < count; i++)
        if (leaves[i] < 0 || leaves[i] >= leaf_count) {
            PyErr_Format(PyExc_IndexError, "tree_update: leaf %lld is off the tree's %lld leaves",
                         (long long)leaves[i], (long long)leaf_count);
            return NULL;
        }
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t node = leaves[i];
        sums[starts[last] + node] = values[i];
        mins[starts[last] + node] = values[i] > 0.0 ? values[i] : INFINITY;
        for (Py_ssize_t d = last; d > 1; d--) {
            const double *child_sums = sums + starts[d] + (node & ~(int64_t)(TREE_K - 1));
            const double *child_mins = mins + starts[d] + (node & ~(int64_t)(TREE_K - 1));
            double sum = 0.0, least = INFINITY;
            for (int j = 0; j < TREE_K; j++) {
                sum += child_sums[j];
                least = child_mins[j] < least ? child_mins[j] : least;
            }
            node /= TREE_K;
            sums[starts[d - 1] + node] = sum;
            mins[starts[d - 1] + node] = least;
        }
    }
    if (count) {
        double sum = 0.0, least = INFINITY;
        for (int64_t j = starts[1]; j < starts[2]; j++) {
            sum += sums[j];
            least = mins[j] < least ? mins[j] : least;
        }
        sums[0] = sum;
        mins[0] = least;
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ messages */

/* new_bytes(size) -> (message, buffer): a new bytes object of `size` bytes, not yet initialized, and a writable
 * uint8 array over them (which keeps the bytes alive). gRPC sends only bytes, and Python can make them only
 * by copying: this lets a batch be gathered straight into the message it is sent in. Bytes are immutable
 * once shared, so the caller fills them through `buffer` before handing `message` to anyone else. */
static PyObject *new_bytes(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    int64_t size;
    if (check_nargs("new_bytes", nargs, 1) || int_arg(args[0], "size", &size)) return NULL;
    if (size < 0 || size > PY_SSIZE_T_MAX / 2) {
        PyErr_Format(PyExc_ValueError, "new_bytes: size must be in 0..%zd, got %lld", PY_SSIZE_T_MAX / 2,
                     (long long)size);
        return NULL;
    }
    PyObject *message = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
    if (!message) return NULL;
    npy_intp shape[1] = {(npy_intp)size};
    PyObject *buffer = PyArray_New(&PyArray_Type, 1, shape, NPY_UINT8, NULL, PyBytes_AS_STRING(message), 0,
                                   NPY_ARRAY_CARRAY, NULL);
    if (!buffer) {
        Py_DECREF(message);
        return NULL;
    }
    Py_INCREF(message); /* PyArray_SetBaseObject steals a reference, on failure too */
    if (PyArray_SetBaseObject((PyArrayObject *)buffer, message) < 0) {
        Py_DECREF(buffer);
        Py_DECREF(message);
        return NULL;
    }
    return Py_BuildValue("(NN)", message, buffer);
}

/* ------------------------------------------------------------------ module */

#define KERNEL(name) {#name, (PyCFunction)(void (*)(void))name, METH_FASTCALL, NULL}
static PyMethodDef kernel_methods[] = {
    KERNEL(episode_bounds),
    KERNEL(draw_uniform),
    KERNEL(transition_batch),
    KERNEL(geometric_batch),
    KERNEL(sequence_batch),
    KERNEL(hindsight_goals),
    KERNEL(bounds_kept),
    KERNEL(drawn_live),
    KERNEL(take_rows),
    KERNEL(stack_frames),
    KERNEL(new_bytes),
    KERNEL(tree_find),
    KERNEL(tree_update),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef kernels_module = {
    .m_base = PyModuleDef_HEAD_INIT, .m_name = "_kernels", .m_size = -1, .m_methods = kernel_methods};

PyMODINIT_FUNC PyInit__kernels(void) {
    import_array();
    if (!(TERMINATED_KEY = PyUnicode_InternFromString("terminated"))
        || !(TRUNCATED_KEY = PyUnicode_InternFromString("truncated"))
        || !(N_STEP_RETURN_KEY = PyUnicode_InternFromString("n_step_return"))
        || !(BOOTSTRAP_DISCOUNT_KEY = PyUnicode_InternFromString("bootstrap_discount"))
        || !(OFFSET_KEY = PyUnicode_InternFromString("offset")) || !(MASK_KEY = PyUnicode_InternFromString("mask"))
        || !(IS_FIRST_KEY = PyUnicode_InternFromString("is_first"))
        || !(BOOTSTRAP_STEP_KEY = PyUnicode_InternFromString("bootstrap_step")))
        return NULL;
    PyObject *module = PyModule_Create(&kernels_module);
    if (module && (PyModule_AddIntConstant(module, "OPEN", OPEN) || PyModule_AddIntConstant(module, "HOLE", HOLE)
                   || PyModule_AddIntConstant(module, "TERMINATED", TERMINATED))) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
