/* The statistics loop of the conversion pass, part of the `_native` module (see `_native.c`).

   numeric_statistics(values, split, train_keys, eval_keys, shift)
       One column of one chunk, float32 or int64 (scalars, or vectors of a fixed width: rows x width values),
       added to both splits at once: `split` is the split of every row (a bool/uint8 buffer, 1 = eval), or an
       int for a chunk that is all one split. A NaN or an INT64_MIN value is missing. Adds each present value's
       sketch bucket (its float32 bits >> shift, a bincount of 1 << (32 - shift) keys) to that split's keys
       (int64, updated in place) and returns, per split (train, eval), the tuple
       (count, missing, mean, m2, min, max), m2 being the sum of squared deviations from the chunk's own mean.

   The numpy path in `pipeline_lib.data.accumulators` computes the same numbers with about ten passes over the
   values and a copy of every column per split; this is two passes (the second one, for m2, over values that
   are still in the cache) with no copy, which is what keeps statistics cheap beside the encoding.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    int64_t count, missing;
    double sum, m2, min, max;
} split_sums;

static inline uint32_t float_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

/* Both passes visit the values row by row: `rows` is the per-row split (1 = eval), or NULL with every row in
   split `all`. ROW_LOOP binds `which` (the row's split) and `x` (each of its `width` values) around BODY. */
#define ROW_LOOP(TYPE, BODY)                                                   \
    for (Py_ssize_t r = 0, i = 0; r < num_rows; r++) {                         \
        int which = rows != NULL ? (rows[r] != 0) : all;                       \
        for (Py_ssize_t j = 0; j < width; j++, i++) {                          \
            TYPE x = v[i];                                                     \
            BODY                                                               \
        }                                                                      \
    }

/* The sums live in locals, not in `s`: the key arrays are int64 too, so through a pointer every increment of a
   key would force the compiler to reload and store them (aliasing), a dependency chain through memory per value. */
#define ADD_VALUES(TYPE, IS_MISSING, AS_FLOAT)                                 \
    int64_t missing[2] = {0, 0};                                               \
    double sum[2] = {0.0, 0.0}, low[2] = {INFINITY, INFINITY};                 \
    double high[2] = {-INFINITY, -INFINITY}, m2[2] = {0.0, 0.0};               \
    int64_t *train_keys = keys[0], *eval_keys = keys[1];                       \
    ROW_LOOP(TYPE, {                                                           \
        if (IS_MISSING) {                                                      \
            missing[which]++;                                                  \
            continue;                                                          \
        }                                                                      \
        double d = (double)x;                                                  \
        sum[which] += d;                                                       \
        low[which] = d < low[which] ? d : low[which];                          \
        high[which] = d > high[which] ? d : high[which];                       \
        (which ? eval_keys : train_keys)[float_bits(AS_FLOAT) >> shift]++;     \
    })                                                                         \
    int64_t count[2] = {0, 0};                                                 \
    if (rows == NULL) {                                                        \
        count[all] = num_rows * width - missing[all];                          \
    } else {                                                                   \
        int64_t num_eval = 0;                                                  \
        for (Py_ssize_t r = 0; r < num_rows; r++) num_eval += rows[r] != 0;    \
        count[1] = num_eval * width - missing[1];                              \
        count[0] = (num_rows - num_eval) * width - missing[0];                 \
    }                                                                          \
    double mean[2] = {count[0] ? sum[0] / (double)count[0] : 0.0,              \
                      count[1] ? sum[1] / (double)count[1] : 0.0};             \
    ROW_LOOP(TYPE, {                                                           \
        if (IS_MISSING) continue;                                              \
        double d = (double)x - mean[which];                                    \
        m2[which] += d * d;                                                    \
    })                                                                         \
    for (int k = 0; k < 2; k++) {                                              \
        s[k].count = count[k], s[k].missing = missing[k], s[k].sum = sum[k];   \
        s[k].m2 = m2[k], s[k].min = low[k], s[k].max = high[k];                \
    }

static void add_floats(const float *v, Py_ssize_t num_rows, Py_ssize_t width, const uint8_t *rows, int all,
                       int64_t *keys[2], int shift, split_sums s[2]) {
    ADD_VALUES(float, isnan(x), x)
}

static void add_ints(const int64_t *v, Py_ssize_t num_rows, Py_ssize_t width, const uint8_t *rows, int all,
                     int64_t *keys[2], int shift, split_sums s[2]) {
    ADD_VALUES(int64_t, x == INT64_MIN, (float)x)
}

PyObject *numeric_statistics(PyObject *self, PyObject *args) {
    PyObject *values_obj, *split_obj, *keys_obj[2];
    int shift;
    if (!PyArg_ParseTuple(args, "OOOOi", &values_obj, &split_obj, &keys_obj[0], &keys_obj[1], &shift)) return NULL;
    if (shift < 1 || shift > 31) return PyErr_Format(PyExc_ValueError, "shift %d must be in 1..31", shift);
    Py_buffer values, split = {0}, keys[2] = {{0}, {0}};
    int have_split = 0, have_keys = 0, all = 0;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(values_obj, &values, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return NULL;
    char kind = values.format ? values.format[strlen(values.format) - 1] : 'B';
    int is_float = kind == 'f' && values.itemsize == 4;
    int is_int = (kind == 'l' || kind == 'q') && values.itemsize == 8;
    if (!is_float && !is_int) {
        PyErr_Format(PyExc_TypeError, "values must be float32 or int64, not format %s", values.format);
        goto done;
    }
    Py_ssize_t n = values.len / values.itemsize, num_rows;
    if (PyLong_Check(split_obj)) {
        all = PyLong_AsLong(split_obj) != 0;
        num_rows = n;
    } else {
        if (PyObject_GetBuffer(split_obj, &split, PyBUF_C_CONTIGUOUS) != 0) goto done;
        have_split = 1;
        num_rows = split.len;
        if (split.itemsize != 1) {
            PyErr_SetString(PyExc_TypeError, "split must be a bool or uint8 array (one entry per row)");
            goto done;
        }
    }
    if (num_rows == 0 ? n != 0 : n % num_rows != 0) {
        PyErr_Format(PyExc_ValueError, "%zd values do not make %zd rows", n, num_rows);
        goto done;
    }
    for (int k = 0; k < 2; k++) {
        if (PyObject_GetBuffer(keys_obj[k], &keys[k], PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) goto done;
        have_keys = k + 1;
        if (keys[k].itemsize != 8 || keys[k].len != ((Py_ssize_t)8 << (32 - shift))) {
            PyErr_Format(PyExc_ValueError, "keys must be int64 arrays of %lld entries", 1LL << (32 - shift));
            goto done;
        }
    }
    split_sums s[2] = {{0, 0, 0.0, 0.0, INFINITY, -INFINITY}, {0, 0, 0.0, 0.0, INFINITY, -INFINITY}};
    int64_t *key_arrays[2] = {(int64_t *)keys[0].buf, (int64_t *)keys[1].buf};
    const uint8_t *rows = have_split ? (const uint8_t *)split.buf : NULL;
    Py_ssize_t width = num_rows ? n / num_rows : 1;
    Py_BEGIN_ALLOW_THREADS
    if (is_float)
        add_floats((const float *)values.buf, num_rows, width, rows, all, key_arrays, shift, s);
    else
        add_ints((const int64_t *)values.buf, num_rows, width, rows, all, key_arrays, shift, s);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("((LLdddd)(LLdddd))",
                           (long long)s[0].count, (long long)s[0].missing,
                           s[0].count ? s[0].sum / (double)s[0].count : 0.0, s[0].m2, s[0].min, s[0].max,
                           (long long)s[1].count, (long long)s[1].missing,
                           s[1].count ? s[1].sum / (double)s[1].count : 0.0, s[1].m2, s[1].min, s[1].max);
done:
    for (int k = 0; k < have_keys; k++) PyBuffer_Release(&keys[k]);
    if (have_split) PyBuffer_Release(&split);
    PyBuffer_Release(&values);
    return result;
}
