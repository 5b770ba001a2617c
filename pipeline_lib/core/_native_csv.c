/* The CSV reader's fast parse, part of the `_native` module (see `_native.c`).

   parse_csv_block(text, delimiter, kinds, outputs, num_lines) -> bytes | False
       Parses a block of `num_lines` whole lines, each ending in b"\n" (or b"\r\n"), straight into typed column
       buffers: `kinds` holds one code per field of a line, b"f" float32, b"q" int64, b"s" ASCII text, b"?" a
       number of either kind (read, not stored), b"-" a field not read; `outputs` holds, in field order, one
       writable buffer of at least `num_lines` values per b"f" or b"q" field, and two per b"s" field: the
       `num_lines + 1` int32 offsets of an Arrow binary array, and room for its bytes (len(text) bytes). Returns the kinds, each b"?" replaced by the kind every
       value of that field has (b"q" if all are int64, else b"f"), when every line had exactly len(kinds)
       fields and every value read was in a plain form below; False as soon as anything is not (the buffers then
       hold nothing of use), and the caller parses the block with Arrow, which names what is wrong. Only a block
       without quotes may be given (the caller checks), so a delimiter always ends a field.

   The plain forms, which Arrow (its int64 parse, and fast_float's correctly rounded float32 parse) reads to the
   same values:
       int64    -?(0|[1-9][0-9]*), at most 18 digits;
       float32  -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]{1,3})? whose digits (the point left out) make an
                integer m <= 2^24 and whose point and exponent a power of ten e with |e| <= 10 (trailing zeros of m
                moved into e): m and 10^|e| are exact in float32, so one IEEE multiplication or division of the
                two rounds correctly (Clinger's fast path).
   Text is plain when it is ASCII (any bytes but the delimiter and line ends; empty too): Arrow's string parse
   keeps it as it is. Anything else (more digits, "inf", "nan", spaces around a number, an empty number, a byte
   of UTF-8 above 0x7F) is not plain: the block goes to Arrow, whose typed parse reads or refuses it and whose
   string parse reports it. This loop takes about 0.4 of the CPU time of
   Arrow's parse of the same block to the same types.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static const float float_powers[] = {1e0f, 1e1f, 1e2f, 1e3f, 1e4f, 1e5f, 1e6f, 1e7f, 1e8f, 1e9f, 1e10f};

static inline int is_digit(char c) { return (unsigned char)(c - '0') < 10; }

/* The forms a number can take here: a bit each, as `read_number` returns them. */
#define INT64_FORM 1
#define FLOAT32_FORM 2

/* The plain forms of the number (-1)^negative * m * 10^e, written with `digits` digits and, when `bare`,
   nothing else (no point, no exponent); its value as int64 in *integer and as float32 in *real for each. */
static inline int number_forms(int negative, uint64_t m, int e, int digits, int bare, int64_t *integer, float *real) {
    int forms = 0;
    if (bare && digits <= 18) {
        *integer = negative ? -(int64_t)m : (int64_t)m;
        forms |= INT64_FORM;
    }
    if (m > (1u << 24) || e < -10)
        while (m != 0 && e < 0 && m % 10 == 0) m /= 10, e++;  /* 1.50 is 15e-1: fewer digits, the same value */
    if (m == 0) e = 0;
    if (m <= (1u << 24) && e >= -10 && e <= 10) {
        const float v = e < 0 ? (float)m / float_powers[-e] : (float)m * float_powers[e];
        *real = negative ? -v : v;
        forms |= FLOAT32_FORM;
    }
    return forms;
}

/* Eight bytes from p, the first in the low byte (x86-64 and other little-endian hosts; big-endian ones take the
   byte loop only). */
static inline uint64_t load8(const char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

/* How many of the eight bytes of w (its first byte first) are digits before the first that is not, 0 to 8. A
   carry out of a byte that is not a digit only reaches the bytes after it, which do not count. */
static inline int leading_digits(uint64_t w) {
    const uint64_t high = 0xF0F0F0F0F0F0F0F0ull, threes = 0x3030303030303030ull;
    const uint64_t not_digit = ((w & high) ^ threes) | (((w + 0x0606060606060606ull) & high) ^ threes);
    return not_digit ? __builtin_ctzll(not_digit) / 8 : 8;
}

/* The value of the first n (1 to 8) digits of w: they are moved to the top bytes, below them zeros, then summed
   pairwise (fast_float's parse_eight_digits_unrolled). A borrow from a byte past them only reaches later bytes,
   which the shift drops. */
static inline uint64_t digits_value(uint64_t w, int n) {
    uint64_t v = (w - 0x3030303030303030ull) << (8 * (8 - n));
    v = v * 10 + (v >> 8);
    return (((v & 0x000000FF000000FFull) * (100 + (1000000ull << 32))) +
            (((v >> 16) & 0x000000FF000000FFull) * (1 + (10000ull << 32)))) >> 32;
}

static const uint64_t integer_powers[] = {1, 10, 100, 1000, 10000, 100000, 1000000, 10000000, 100000000};

/* The number at *p (up to `end`, exclusive): returns the plain forms it has (0: none, *p unmoved), with its value
   as int64 in *integer when it has the int64 form and as float32 in *real when it has the float32 form, and moves
   *p past it. Most numbers in a CSV file are a few digits, a point and a few more: those take eight bytes at a
   time, with no branch on each digit; the rest (an exponent, 8 or more digits on a side of the point, the
   block's last bytes) the loop below. */
static inline int read_number(const char **p, const char *end, int64_t *integer, float *real) {
    const char *s = *p;
    const int negative = s < end && *s == '-';
    s += negative;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (end - s >= 18) {
        const uint64_t w = load8(s);
        const int whole = leading_digits(w);
        if (whole > 0 && whole < 8 && (whole == 1 || *s != '0')) {
            const char *after = s + whole;
            uint64_t m = digits_value(w, whole);
            int fraction = 0;
            if (*after == '.') {
                const uint64_t f = load8(after + 1);
                fraction = leading_digits(f);
                if (fraction > 0 && fraction < 8) {
                    m = m * integer_powers[fraction] + digits_value(f, fraction);
                    after += 1 + fraction;
                } else {
                    fraction = -1;
                }
            }
            if (fraction >= 0 && *after != 'e' && *after != 'E') {
                const int forms = number_forms(negative, m, -fraction, whole + fraction, fraction == 0, integer, real);
                if (forms) *p = after;
                return forms;
            }
        }
    }
#endif
    const char *first = s;
    uint64_t m = 0;
    while (s < end && is_digit(*s)) m = m * 10 + (uint64_t)(*s++ - '0');
    int digits = (int)(s - first), e = 0;
    if (digits == 0 || (digits > 1 && *first == '0')) return 0;
    if (s < end && *s == '.') {
        const char *fraction = ++s;
        while (s < end && is_digit(*s)) m = m * 10 + (uint64_t)(*s++ - '0');
        if (s == fraction) return 0;
        e = -(int)(s - fraction);
        digits += (int)(s - fraction);
    }
    if (s < end && (*s == 'e' || *s == 'E')) {
        s++;
        const int minus = s < end && (*s == '-' || *s == '+') ? *s++ == '-' : 0;
        const char *start = s;
        int power = 0;
        while (s < end && is_digit(*s) && s - start < 3) power = power * 10 + (*s++ - '0');
        if (s == start || (s < end && is_digit(*s))) return 0;
        e += minus ? -power : power;
    }
    if (digits > 19) return 0;  /* m would have overflowed */
    const int forms = number_forms(negative, m, e, digits, s == first + digits, integer, real);
    if (forms) *p = s;
    return forms;
}

/* One field's value into column `out` at row `row` (kind b"f" or b"q"); 0 when it is not plain. */
static inline int read_value(const char **p, const char *end, char kind, void *out, Py_ssize_t row) {
    int64_t integer;
    float real;
    const int forms = read_number(p, end, &integer, &real);
    if (kind == 'q' && (forms & INT64_FORM)) {
        ((int64_t *)out)[row] = integer;
        return 1;
    }
    if (kind == 'f' && (forms & FLOAT32_FORM)) {
        ((float *)out)[row] = real;
        return 1;
    }
    return 0;
}

/* The block's lines into the columns; 0 at the first thing that is not plain. A field of kind b"?" is only
   read: forms[i] keeps the forms that every value of the i-th such field had; one of kind b"s" takes two
   outputs, its offsets and its bytes. */
static int parse_lines(const char *text, Py_ssize_t size, char delimiter, const char *kinds, Py_ssize_t num_fields,
                       void *const *outs, int *forms, Py_ssize_t num_lines) {
    const char *p = text, *end = text + size;
    for (Py_ssize_t row = 0; row < num_lines; row++) {
        Py_ssize_t column = 0, guessed = 0;
        for (Py_ssize_t field = 0; field < num_fields; field++) {
            const char kind = kinds[field];
            if (kind == '-') {
                while (p < end && *p != delimiter && *p != '\n' && *p != '\r') p++;
            } else if (kind == 's') {
                int32_t *offsets = outs[column];
                char *data = outs[column + 1];
                column += 2;
                const char *start = p;
                while (p < end && *p != delimiter && *p != '\n' && *p != '\r') {
                    if ((unsigned char)*p >= 0x80) return 0;  /* not ASCII: Arrow's parse checks the UTF-8 */
                    p++;
                }
                if (row == 0) offsets[0] = 0;
                memcpy(data + offsets[row], start, (size_t)(p - start));
                offsets[row + 1] = offsets[row] + (int32_t)(p - start);
            } else if (kind == '?') {
                int64_t integer;
                float real;
                if (!(forms[guessed++] &= read_number(&p, end, &integer, &real))) return 0;
            } else if (!read_value(&p, end, kind, outs[column++], row)) {
                return 0;
            }
            if (p >= end) return 0;
            if (field + 1 < num_fields) {
                if (*p != delimiter) return 0;
                p++;
            }
        }
        if (*p == '\r') p++;  /* b"\r\n" ends a line too; a lone b"\r" does not */
        if (p >= end || *p != '\n') return 0;
        p++;
    }
    return p == end;
}

PyObject *parse_csv_block(PyObject *self, PyObject *args) {
    Py_buffer text, kinds;
    PyObject *outputs;
    const char *delimiter;
    Py_ssize_t delimiter_size, num_lines;
    if (!PyArg_ParseTuple(args, "y*s#y*On", &text, &delimiter, &delimiter_size, &kinds, &outputs, &num_lines))
        return NULL;
    PyObject *result = NULL, *sequence = NULL;
    const char *codes = kinds.buf;
    Py_ssize_t wanted = 0, num_views = 0, guessed = 0;
    Py_buffer *views = NULL;
    void **outs = NULL;
    int *forms = NULL;
    if (delimiter_size != 1 || num_lines < 0 || text.len >= INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "need a one-byte delimiter, num_lines >= 0 and a text under 2 GiB");
        goto done;
    }
    for (Py_ssize_t i = 0; i < kinds.len; i++) {
        if (codes[i] == '\0' || !strchr("fqs?-", codes[i])) {
            PyErr_Format(PyExc_ValueError, "kind %zd is %d, not one of b'f', b'q', b's', b'?', b'-'", i, (int)codes[i]);
            goto done;
        }
        wanted += codes[i] == 'f' || codes[i] == 'q' ? 1 : codes[i] == 's' ? 2 : 0;
        guessed += codes[i] == '?';
    }
    sequence = PySequence_Fast(outputs, "outputs must be a sequence of buffers");
    if (sequence == NULL) goto done;
    if (PySequence_Fast_GET_SIZE(sequence) != wanted) {
        PyErr_Format(PyExc_ValueError, "%zd output buffers where the kinds need %zd", PySequence_Fast_GET_SIZE(sequence),
                     wanted);
        goto done;
    }
    views = PyMem_Calloc(wanted + 1, sizeof *views);
    outs = PyMem_Calloc(wanted + 1, sizeof *outs);
    forms = PyMem_Malloc((guessed + 1) * sizeof *forms);
    if (views == NULL || outs == NULL || forms == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < kinds.len; i++) {
        /* the bytes each output needs: a value a line, or a string column's offsets and bytes */
        Py_ssize_t needs[2] = {num_lines * (codes[i] == 'f' ? 4 : 8), 0}, parts = 1;
        if (codes[i] == '-' || codes[i] == '?') continue;
        if (codes[i] == 's') needs[0] = (num_lines + 1) * 4, needs[1] = text.len, parts = 2;
        for (Py_ssize_t part = 0; part < parts; part++) {
            Py_buffer *view = &views[num_views];
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(sequence, num_views), view, PyBUF_WRITABLE) < 0) goto done;
            outs[num_views++] = view->buf;
            if (view->len < needs[part]) {
                PyErr_Format(PyExc_ValueError, "output %zd holds %zd bytes, fewer than the %zd it needs for %zd lines",
                             num_views - 1, view->len, needs[part], num_lines);
                goto done;
            }
        }
    }
    for (Py_ssize_t i = 0; i < guessed; i++) forms[i] = INT64_FORM | FLOAT32_FORM;
    int parsed;
    Py_BEGIN_ALLOW_THREADS
    parsed = parse_lines(text.buf, text.len, delimiter[0], codes, kinds.len, outs, forms, num_lines);
    Py_END_ALLOW_THREADS
    if (!parsed) {
        result = Py_NewRef(Py_False);
        goto done;
    }
    /* the kinds, each b"?" replaced by the one it has (a new object: one-byte bytes objects are shared) */
    result = PyBytes_FromStringAndSize(NULL, kinds.len);
    if (result == NULL) goto done;
    for (Py_ssize_t i = 0, j = 0; i < kinds.len; i++)
        PyBytes_AS_STRING(result)[i] = codes[i] != '?' ? codes[i] : forms[j++] & INT64_FORM ? 'q' : 'f';
done:
    for (Py_ssize_t i = 0; i < num_views; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(outs);
    PyMem_Free(forms);
    Py_XDECREF(sequence);
    PyBuffer_Release(&kinds);
    PyBuffer_Release(&text);
    return result;
}

/* csv_record_ends(text, delimiter, quote, start, state, limit) -> (ends, state)

   Where the records of RFC 4180 CSV end: the position after each b"\n" that is not inside a quoted field, from
   `start` on, as the bytes of an int64 array; at most `limit` of them (limit <= 0: every one). `state` is the
   scanner's state at `start` (RECORD_START at a record's start) and the returned one its state where the scan
   stopped (after the last end, when `limit` ended it; at the end of the text otherwise), so a scan resumes over
   bytes read later. `quote` is the quote byte, or -1 for CSV without quoting.

   The rules are Arrow's parser's (`pyarrow.csv`): a quote opens a quoted field only as a field's first byte; in
   a quoted field, two quotes are one quote and one quote closes it; after the closing quote, bytes up to the
   next delimiter or line end belong to the field. A lone b"\r" is a byte like any other here (the reader sends
   blocks holding one to Arrow's line-by-line parse). */
#define RECORD_START 0 /* also the start of any field */
#define IN_FIELD 1
#define IN_QUOTES 2
#define QUOTE_IN_QUOTES 3 /* a quote inside a quoted field: it closes the field, or a second one follows */

PyObject *csv_record_ends(PyObject *self, PyObject *args) {
    Py_buffer text;
    const char *delimiter;
    Py_ssize_t delimiter_size, start, limit;
    int quote, state;
    if (!PyArg_ParseTuple(args, "y*s#inin", &text, &delimiter, &delimiter_size, &quote, &start, &state, &limit))
        return NULL;
    PyObject *result = NULL;
    int64_t *ends = NULL;
    Py_ssize_t count = 0, capacity = 1024;
    if (delimiter_size != 1 || start < 0 || start > text.len || state < RECORD_START || state > QUOTE_IN_QUOTES) {
        PyErr_SetString(PyExc_ValueError, "need a one-byte delimiter, 0 <= start <= len(text) and a state 0..3");
        goto done;
    }
    ends = PyMem_Malloc(capacity * sizeof *ends);
    if (ends == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const unsigned char *p = (const unsigned char *)text.buf + start, *end = (const unsigned char *)text.buf + text.len;
    const unsigned char d = (unsigned char)delimiter[0];
    const int q = quote;
    while (p < end) {
        const unsigned char c = *p++;
        switch (state) {
        case IN_QUOTES:
            if (c == q) state = QUOTE_IN_QUOTES;
            else {  /* the rest of the quoted text up to the next quote in one step */
                const unsigned char *next = memchr(p, q, (size_t)(end - p));
                p = next ? next : end;
            }
            continue;
        case QUOTE_IN_QUOTES:
            if (c == q) {
                state = IN_QUOTES;
                continue;
            }
            break;
        case RECORD_START:
            if (c == q) {
                state = IN_QUOTES;
                continue;
            }
            break;
        }
        /* outside quotes (a field's first byte, a plain field, or after a closing quote) */
        if (c == '\n') {
            if (count == capacity) {
                int64_t *grown = PyMem_Realloc(ends, 2 * capacity * sizeof *ends);
                if (grown == NULL) {
                    PyErr_NoMemory();
                    goto done;
                }
                ends = grown, capacity *= 2;
            }
            ends[count++] = (int64_t)(p - (const unsigned char *)text.buf);
            state = RECORD_START;
            if (limit > 0 && count == limit) break;
        } else {
            state = c == d ? RECORD_START : IN_FIELD;
        }
    }
    PyObject *array = PyBytes_FromStringAndSize((const char *)ends, count * (Py_ssize_t)sizeof *ends);
    if (array != NULL) result = Py_BuildValue("(Ni)", array, state);
done:
    PyMem_Free(ends);
    PyBuffer_Release(&text);
    return result;
}
