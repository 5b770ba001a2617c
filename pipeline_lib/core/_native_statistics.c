/* The statistics loop of the conversion pass, part of the `_native` module (see `_native.c`).

   numeric_statistics(values, split, train_keys, eval_keys, shift)
       One column of one chunk, float32 or int64 (scalars, or vectors of a fixed width: rows x width values),
       added to both splits at once: `split` is the split of every row (a bool/uint8 buffer, 1 = eval), or an
       int for a chunk that is all one split. A NaN or an INT64_MIN value is missing. Adds each present value's
       sketch bucket (its float32 bits >> shift, a bincount of 1 << (32 - shift) keys) to that split's keys
       (int64, updated in place) and returns, per split (train, eval), the tuple
       (count, missing, mean, m2, min, max), m2 being the sum of squared deviations from the chunk's own mean.

   The numpy path in `pipeline_lib.data.accumulators` computes the same numbers with about ten passes over the
   values and a copy of every column per split; this reads each value once from memory (then twice more from a
   block buffer in L1), which is what keeps statistics cheap beside the encoding. Float32 values on a CPU with
   AVX-512 take a masked vector loop instead (`add_floats_512`), with no block buffers.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    int64_t count, missing;
    double mean, m2, min, max;
} split_sums;

static inline uint32_t float_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

/* Values go through in blocks of BLOCK, each split's present ones first copied into a buffer of its own: then
   the sums run over plain arrays in L1 with no test per value, and each block's mean and m2 merge into the
   split's with Chan's update (as NumericAccumulator merges chunks). A test or a select per value on its split
   and on NaN, in the summing loop itself, made it several times slower: the 20 % eval rows fall at random. */
#define BLOCK 2048
#define LANES 4 /* independent sums, so that the additions do not wait on one another */

/* A block's (n, mean, m2) into the split's with Chan, Golub and LeVeque's update (as NumericAccumulator merges
   chunks), and its extremes. */
static void merge_block(split_sums *s, Py_ssize_t n, double mean, double block_m2, double low, double high) {
    if (n == 0) return;
    s->min = low < s->min ? low : s->min;
    s->max = high > s->max ? high : s->max;
    double count = (double)s->count, merged = count + (double)n, delta = mean - s->mean;
    s->mean += delta * (double)n / merged;
    s->m2 += block_m2 + delta * delta * count * (double)n / merged;
    s->count += n;
}

static void add_block(split_sums *s, const double *x, Py_ssize_t n) {
    if (n == 0) return;
    double sum[LANES] = {0}, low[LANES], high[LANES], m2[LANES] = {0};
    for (int k = 0; k < LANES; k++) low[k] = INFINITY, high[k] = -INFINITY;
    Py_ssize_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) {
            double d = x[i + k];
            sum[k] += d;
            low[k] = d < low[k] ? d : low[k];
            high[k] = d > high[k] ? d : high[k];
        }
    for (; i < n; i++) {
        sum[0] += x[i];
        low[0] = x[i] < low[0] ? x[i] : low[0];
        high[0] = x[i] > high[0] ? x[i] : high[0];
    }
    double total = 0.0;
    for (int k = 0; k < LANES; k++) {
        total += sum[k];
        low[0] = low[k] < low[0] ? low[k] : low[0];
        high[0] = high[k] > high[0] ? high[k] : high[0];
    }
    double mean = total / (double)n;
    for (i = 0; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) {
            double d = x[i + k] - mean;
            m2[k] += d * d;
        }
    for (; i < n; i++) m2[0] += (x[i] - mean) * (x[i] - mean);
    merge_block(s, n, mean, m2[0] + m2[1] + m2[2] + m2[3], low[0], high[0]);
}

/* One value `x` of a row of split `eval`, written to both splits' buffers and kept by its split's length alone; its
   sketch key counted in keys[eval], indexed: a choice between the two arrays compiled to a branch, which the split,
   falling at random, mispredicted. */
#define TO_BOTH_BUFFERS(IS_PRESENT, AS_FLOAT)                                                  \
    {                                                                                          \
        const int present = (IS_PRESENT);                                                      \
        keys[eval][float_bits(AS_FLOAT) >> shift] += present;                                  \
        const double d = (double)x;                                                            \
        buffer[1][length[1]] = d;                                                              \
        buffer[0][length[0]] = d;                                                              \
        length[1] += eval & present;                                                           \
        length[0] += (!eval) & present;                                                        \
        num_eval += eval;                                                                      \
    }

/* One block of `num_rows` rows of `width` values each: copy each present value into its split's buffer, count its
   sketch key, then sum. Rows of WIDE_ROWS values or more look their split up once per row and write each value to
   that split's buffer alone (a third faster for rows of 32 floats); narrower rows write each value to both buffers
   and keep it by advancing its split's length only, with no branch on the split, which falls at random (scalars,
   the common case, without the row and column count: 7 % faster). Either way each split's buffer holds
   its values in the same order, so the sums are the same to the bit. */
#define WIDE_ROWS 8
#define ADD_VALUES(TYPE, IS_PRESENT, AS_FLOAT)                                                  \
    double buffer[2][BLOCK];                                                                   \
    const Py_ssize_t n = num_rows * width;                                                     \
    Py_ssize_t row = 0, column = 0;                                                            \
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {                                    \
        const Py_ssize_t stop = start + BLOCK < n ? start + BLOCK : n;                         \
        Py_ssize_t length[2] = {0, 0}, num_eval = 0;                                           \
        if (width >= WIDE_ROWS) {                                                              \
            Py_ssize_t i = start;                                                              \
            while (i < stop) {                                                                 \
                const int eval = rows != NULL ? (rows[row] != 0) : all;                        \
                const Py_ssize_t end = i + width - column < stop ? i + width - column : stop;  \
                int64_t *k = keys[eval];                                                       \
                double *b = buffer[eval];                                                      \
                Py_ssize_t len = length[eval];                                                 \
                if (eval) num_eval += end - i;                                                 \
                column += end - i;                                                             \
                for (; i < end; i++) {                                                         \
                    const TYPE x = v[i];                                                       \
                    const int present = (IS_PRESENT);                                          \
                    k[float_bits(AS_FLOAT) >> shift] += present;                               \
                    b[len] = (double)x;                                                        \
                    len += present;                                                            \
                }                                                                              \
                length[eval] = len;                                                            \
                if (column == width) column = 0, row++;                                        \
            }                                                                                  \
        } else if (width == 1) { /* scalars: value i is row i, no row bookkeeping */           \
            for (Py_ssize_t i = start; i < stop; i++) {                                        \
                const TYPE x = v[i];                                                           \
                const int eval = rows != NULL ? (rows[i] != 0) : all;                          \
                TO_BOTH_BUFFERS(IS_PRESENT, AS_FLOAT)                                          \
            }                                                                                  \
        } else {                                                                               \
            for (Py_ssize_t i = start; i < stop; i++) {                                        \
                const TYPE x = v[i];                                                           \
                const int eval = rows != NULL ? (rows[row] != 0) : all;                        \
                TO_BOTH_BUFFERS(IS_PRESENT, AS_FLOAT)                                          \
                if (++column == width) column = 0, row++;                                      \
            }                                                                                  \
        }                                                                                      \
        s[1].missing += num_eval - length[1];                                                  \
        s[0].missing += (stop - start - num_eval) - length[0];                                 \
        add_block(&s[0], buffer[0], length[0]);                                                \
        add_block(&s[1], buffer[1], length[1]);                                                \
    }

/* The same loop for float32 values on CPUs with AVX-512 (F, VL, DQ, BW; chosen by `choose_vector_statistics`, at load
   time and by `use_hardware`): eight values at a time, each split's sums, extremes and counts kept under its lanes'
   mask, with no copy into split buffers and one pass over the values. The pass stores, per value, the address of its
   sketch counter (its key in its split's table; key 0 for a missing value, taken back after), so the count is then
   one increment per stored address with no split to look up (faster than counting by key and split).
   Each split sums d = x - origin and d * d, the origin being its mean so far (its first present value in the block
   while it has none), so the block's m2 = sum(d * d) - sum(d)^2 / n, with no second pass for the squared deviations from
   the block's mean (extremes are taken on the float32 values). The
   origin is one of the values seen or their mean, so the subtraction cancels little: means and variances agree with
   numpy's to 1e-13 relative on data centred far from 0 (1e4 +- 1e-2, 1e6 +- 1, a drift, modes at +-1e5, scales of
   1e+-30), as the portable loop's do; the keys are the same (an int column still takes the loop above; the
   speed-up is in bench/results.json). */
static int vector_statistics = 0;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#include <immintrin.h>
#define HAVE_FLOATS_512 1

__attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,popcnt")))
static void add_floats_512(const float *v, Py_ssize_t num_rows, Py_ssize_t width, const uint8_t *rows, int all,
                           int64_t *keys[2], int shift, split_sums s[2]) {
    const Py_ssize_t n = num_rows * width;
    int64_t *counter[BLOCK];        /* each value's sketch counter: the address of its key in its split's table */
    uint8_t value_split[BLOCK];     /* each value's split, for rows of several values */
    const __m128i key_shift = _mm_cvtsi32_si128(shift);
    const __m512i table[2] = {_mm512_set1_epi64((long long)(intptr_t)keys[0]),
                              _mm512_set1_epi64((long long)(intptr_t)keys[1])};
    Py_ssize_t row = 0, column = 0;
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        const Py_ssize_t length = start + BLOCK < n ? BLOCK : n - start;
        const uint8_t *split = NULL; /* NULL: every value is in split `all` */
        if (rows != NULL && width == 1) {
            split = rows + start;
        } else if (rows != NULL) {
            for (Py_ssize_t j = 0; j < length;) {
                const Py_ssize_t run = width - column < length - j ? width - column : length - j;
                memset(value_split + j, rows[row] != 0, (size_t)run);
                j += run;
                column += run;
                if (column == width) column = 0, row++;
            }
            split = value_split;
        }
        /* The origin of a split with no values yet: its first present value in the block (another split's values
           may be far from this one's: a deviation from them would cancel this split's values out). */
        double first[2] = {0.0, 0.0};
        int found[2] = {s[0].count != 0 || (split == NULL && all != 0), s[1].count != 0 || (split == NULL && all == 0)};
        for (Py_ssize_t j = 0; (!found[0] || !found[1]) && j < length; j++) {
            const int k = split != NULL ? split[j] != 0 : all != 0;
            if (!found[k] && v[start + j] == v[start + j]) first[k] = v[start + j], found[k] = 1;
        }
        __m512d sum[2], square[2], origin[2];
        __m256 low[2], high[2];
        for (int k = 0; k < 2; k++) {
            sum[k] = square[k] = _mm512_setzero_pd();
            low[k] = _mm256_set1_ps(INFINITY);
            high[k] = _mm256_set1_ps(-INFINITY);
            origin[k] = _mm512_set1_pd(s[k].count ? s[k].mean : first[k]);
        }
        Py_ssize_t count[2] = {0, 0}, num_eval = 0;
        for (Py_ssize_t j = 0; j < length; j += 8) {
            const __mmask8 valid = length - j >= 8 ? 0xFF : (__mmask8)((1u << (length - j)) - 1);
            __mmask8 eval = all ? valid : 0;
            if (split != NULL) {
                const __m128i bytes = _mm_maskz_loadu_epi8(valid, split + j);
                eval = (__mmask8)_mm_test_epi8_mask(bytes, bytes);
            }
            const __m256 f = _mm256_maskz_loadu_ps(valid, v + start + j);
            const __m512d d = _mm512_cvtps_pd(f);
            const __mmask8 present = _mm512_mask_cmp_pd_mask(valid, d, d, _CMP_ORD_Q);
            const __m256i bucket = _mm256_srl_epi32(_mm256_castps_si256(f), key_shift);
            const __m512i offset = _mm512_slli_epi64(_mm512_cvtepu32_epi64(_mm256_maskz_mov_epi32(present, bucket)), 3);
            _mm512_storeu_si512((void *)(counter + j),
                                _mm512_add_epi64(_mm512_mask_blend_epi64(eval, table[0], table[1]), offset));
            const __mmask8 chosen[2] = {present & ~eval, present & eval};
            num_eval += __builtin_popcount(eval);
            for (int k = 0; k < 2; k++) {
                const __mmask8 m = chosen[k];
                const __m512d deviation = _mm512_sub_pd(d, origin[k]);
                count[k] += __builtin_popcount(m);
                sum[k] = _mm512_mask_add_pd(sum[k], m, sum[k], deviation);
                square[k] = _mm512_mask3_fmadd_pd(deviation, deviation, square[k], m);
                low[k] = _mm256_mask_min_ps(low[k], m, low[k], f);
                high[k] = _mm256_mask_max_ps(high[k], m, high[k], f);
            }
        }
        for (Py_ssize_t j = 0; j < length; j++) ++*counter[j];
        const Py_ssize_t missing[2] = {length - num_eval - count[0], num_eval - count[1]};
        for (int k = 0; k < 2; k++) {
            keys[k][0] -= missing[k];
            s[k].missing += missing[k];
            if (!count[k]) continue;
            const double n = (double)count[k], total = _mm512_reduce_add_pd(sum[k]);
            const double m2 = _mm512_reduce_add_pd(square[k]) - total * total / n;
            merge_block(&s[k], count[k], _mm512_cvtsd_f64(origin[k]) + total / n, m2 > 0.0 ? m2 : 0.0,
                        _mm512_reduce_min_pd(_mm512_cvtps_pd(low[k])), _mm512_reduce_max_pd(_mm512_cvtps_pd(high[k])));
        }
    }
}
#endif

/* Whether this extension has the AVX-512 loop and the CPU what it needs. */
static int can_vector_statistics(void) {
#ifdef HAVE_FLOATS_512
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("popcnt");
#else
    return 0;
#endif
}

/* Float32 values take the AVX-512 loop when `on` and it can run (`_native.c`: at load time and in `use_hardware`). */
void choose_vector_statistics(int on) { vector_statistics = on && can_vector_statistics(); }

int vector_statistics_on(void) { return vector_statistics; }

/* statistics_loop(): the loop float32 values take now. */
PyObject *statistics_loop(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(vector_statistics ? "AVX-512" : "portable");
}

static void add_floats(const float *v, Py_ssize_t num_rows, Py_ssize_t width, const uint8_t *rows, int all,
                       int64_t *keys[2], int shift, split_sums s[2]) {
#ifdef HAVE_FLOATS_512
    if (vector_statistics) {
        add_floats_512(v, num_rows, width, rows, all, keys, shift, s);
        return;
    }
#endif
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
    split_sums s[2] = {{0, 0, 0.0, 0.0, INFINITY, -INFINITY}, {0, 0, 0.0, 0.0, INFINITY, -INFINITY}};  /* count, missing, mean, m2, min, max */
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
                           (long long)s[0].count, (long long)s[0].missing, s[0].mean, s[0].m2, s[0].min, s[0].max,
                           (long long)s[1].count, (long long)s[1].missing, s[1].mean, s[1].m2, s[1].min, s[1].max);
done:
    for (int k = 0; k < have_keys; k++) PyBuffer_Release(&keys[k]);
    if (have_split) PyBuffer_Release(&split);
    PyBuffer_Release(&values);
    return result;
}
