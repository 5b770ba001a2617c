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
   split `all`. ROW_LOOP binds `eval` (whether the row is an eval row) and `x` (each of its values) around BODY. */
#define ROW_LOOP(TYPE, BODY)                                                   \
    for (Py_ssize_t r = 0, i = 0; r < num_rows; r++) {                         \
        const int eval = rows != NULL ? (rows[r] != 0) : all;                  \
        for (Py_ssize_t j = 0; j < width; j++, i++) {                          \
            const TYPE x = v[i];                                               \
            BODY                                                               \
        }                                                                      \
    }

/* Every sum is a scalar local per split, updated through selects, not an array indexed by the split: array slots
   would live in memory (and the int64 keys may alias them), making each addition wait on the store before it;
   in registers the two splits' chains run side by side. A missing value adds 0 and compares false. */
#define ADD_VALUES(TYPE, IS_PRESENT, AS_FLOAT)                                 \
    int64_t present_t = 0, present_e = 0, rows_e = 0;                          \
    double sum_t = 0.0, sum_e = 0.0, m2_t = 0.0, m2_e = 0.0;                   \
    double low_t = INFINITY, low_e = INFINITY;                                 \
    double high_t = -INFINITY, high_e = -INFINITY;                             \
    int64_t *train_keys = keys[0], *eval_keys = keys[1];                       \
    ROW_LOOP(TYPE, {                                                           \
        const int present = (IS_PRESENT);                                      \
        const double d = present ? (double)x : 0.0;                            \
        present_e += eval & present;                                           \
        present_t += (!eval) & present;                                        \
        sum_e += eval ? d : 0.0;                                               \
        sum_t += eval ? 0.0 : d;                                               \
        low_e = eval && present && d < low_e ? d : low_e;                      \
        low_t = !eval && present && d < low_t ? d : low_t;                     \
        high_e = eval && present && d > high_e ? d : high_e;                   \
        high_t = !eval && present && d > high_t ? d : high_t;                  \
        (eval ? eval_keys : train_keys)[float_bits(AS_FLOAT) >> shift] += present; \
    })                                                                         \
    if (rows == NULL) {                                                        \
        rows_e = all ? num_rows : 0;                                           \
    } else {                                                                   \
        for (Py_ssize_t r = 0; r < num_rows; r++) rows_e += rows[r] != 0;      \
    }                                                                          \
    const double mean_t = present_t ? sum_t / (double)present_t : 0.0;         \
    const double mean_e = present_e ? sum_e / (double)present_e : 0.0;         \
    ROW_LOOP(TYPE, {                                                           \
        const int present = (IS_PRESENT);                                      \
        const double d = present ? (double)x - (eval ? mean_e : mean_t) : 0.0; \
        m2_e += eval ? d * d : 0.0;                                            \
        m2_t += eval ? 0.0 : d * d;                                            \
    })                                                                         \
    s[0] = (split_sums){present_t, (num_rows - rows_e) * width - present_t,    \
                       sum_t, m2_t, low_t, high_t};                            \
    s[1] = (split_sums){present_e, rows_e * width - present_e,                 \
                       sum_e, m2_e, low_e, high_e};

static void add_floats(const float *v, Py_ssize_t num_rows, Py_ssize_t width, const uint8_t *rows, int all,
                       int64_t *keys[2], int shift, split_sums s[2]) {
    ADD_VALUES(float, !isnan(x), x)
}

static void add_ints(const int64_t *v, Py_ssize_t num_rows, Py_ssize_t width, const uint8_t *rows, int all,
                     int64_t *keys[2], int shift, split_sums s[2]) {
    ADD_VALUES(int64_t, x != INT64_MIN, (float)x)
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
