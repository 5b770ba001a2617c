/* Native loops of the conversion fast path: TFRecord CRCs and the split hash, one C loop over all rows.

   Python would pay one call per record for each (about 0.5 us: as much as encoding the record). Both
   functions take buffers (numpy arrays), write their results in place, and release the GIL, so the writer
   threads run beside them. `pipeline_lib.data.encoding` and `pipeline_lib.data.conversion` keep a pure-Python path that
   gives the same bytes and is used when this module is not built (a test compares the two).

   frame_offsets(data, offsets)  records back to back, record i = data[offsets[i]:offsets[i+1]], each
                                 u64 length | u32 masked crc(length) | payload | u32 masked crc(payload):
                                 writes the last field of every record.
   frame_rows(out, template, pieces, order)
                                 builds fixed-width records and frames them in one pass: output row j is
                                 `template` with each (position, column) of `pieces` copied in from source row
                                 order[j] (row j when order is None), then its payload CRC.
   start_writeback(fd, offset, n)
                                 ask the kernel to start writing bytes [offset, offset + n) of a file to its
                                 device now, without waiting (Linux sync_file_range; a no-op elsewhere), so a
                                 later fsync has little left to wait for.
   use_hardware(flag)            switch between the CPU's crc32 instruction and the table loop (for tests);
                                 crc_loop() says which one runs now.
   string_words(data, starts, lengths, out)
                                 the split hash's word of each string (int64 starts and lengths into data):
                                 its CRC32C, its length in the high 32 bits.
   split_hash(h, words, k, name) for each row r: with `name`, h[r] = mix(h[r] ^ name); then for each of its k
                                 words w (uint64, or uint32 zero-extended): h[r] = mix(h[r] ^ w), mix being
                                 splitmix64's finalizer (the numpy loop in pipeline_lib.data.split.split_hash).
   numeric_statistics(...)       one numeric column's statistics for both splits (in _native_statistics.c).
   parse_csv_block(...)          a block of plain CSV lines straight into float32 and int64 columns (in
                                 _native_csv.c).
   csv_record_ends(...)          where the records of a block of CSV end: the line ends outside quoted fields (in
                                 _native_csv.c).
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h> /* first: its pyconfig.h defines _GNU_SOURCE, which sync_file_range needs */
#ifdef __linux__
#include <fcntl.h>
#endif
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#define TFDAG_X86 1
#include <nmmintrin.h>
#endif

static uint32_t crc_table[8][256];
static int have_sse42 = 0;

static void init_tables(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
}

static uint32_t crc32c_sw(const uint8_t *p, size_t n) {
    uint32_t crc = 0xFFFFFFFFu;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc;  /* little-endian hosts; big-endian ones are not a target of this project */
        crc = crc_table[7][w & 0xFF] ^ crc_table[6][(w >> 8) & 0xFF] ^ crc_table[5][(w >> 16) & 0xFF] ^
              crc_table[4][(w >> 24) & 0xFF] ^ crc_table[3][(w >> 32) & 0xFF] ^ crc_table[2][(w >> 40) & 0xFF] ^
              crc_table[1][(w >> 48) & 0xFF] ^ crc_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) crc = crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return crc ^ 0xFFFFFFFFu;
}

#ifdef TFDAG_X86
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(const uint8_t *p, size_t n) {
    uint64_t crc = 0xFFFFFFFFu;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        crc = _mm_crc32_u64(crc, w);
        p += 8;
        n -= 8;
    }
    uint32_t c = (uint32_t)crc;
    while (n--) c = _mm_crc32_u8(c, *p++);
    return c ^ 0xFFFFFFFFu;
}
#endif

static inline uint32_t crc32c(const uint8_t *p, size_t n) {
#ifdef TFDAG_X86
    if (have_sse42) return crc32c_hw(p, n);
#endif
    return crc32c_sw(p, n);
}

static inline void put_masked(uint8_t *out, uint32_t crc) {
    uint32_t masked = ((crc >> 15) | (crc << 17)) + 0xA282EAD8u;
    out[0] = masked & 0xFF;
    out[1] = (masked >> 8) & 0xFF;
    out[2] = (masked >> 16) & 0xFF;
    out[3] = masked >> 24;
}

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) != 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s buffer (a numpy array)", what,
                     writable ? ", writable" : "");
        return -1;
    }
    return 0;
}

static PyObject *frame_offsets(PyObject *self, PyObject *args) {
    PyObject *data_obj, *offsets_obj;
    if (!PyArg_ParseTuple(args, "OO", &data_obj, &offsets_obj)) return NULL;
    Py_buffer data, offsets;
    if (get_buffer(data_obj, &data, 1, "data") != 0) return NULL;
    if (get_buffer(offsets_obj, &offsets, 0, "offsets") != 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    int ok = 1;
    if (offsets.itemsize != 8 || offsets.len < 8) {
        PyErr_SetString(PyExc_TypeError, "offsets must be an int64 array of at least one entry");
        ok = 0;
    }
    const int64_t *off = (const int64_t *)offsets.buf;
    Py_ssize_t n = ok ? offsets.len / 8 - 1 : 0;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        if (off[i] < 0 || off[i + 1] - off[i] < 16 || off[i + 1] > data.len) {
            PyErr_Format(PyExc_ValueError, "record %zd spans [%lld, %lld) of a %zd-byte buffer: not a framed record",
                         i, (long long)off[i], (long long)off[i + 1], data.len);
            ok = 0;
        }
    }
    if (ok) {
        uint8_t *base = (uint8_t *)data.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            uint8_t *record = base + off[i];
            size_t size = (size_t)(off[i + 1] - off[i]);
            put_masked(record + size - 4, crc32c(record + 12, size - 16));
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&data);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* One column of frame_rows: row r of the source is `base + r * stride`, `width` contiguous bytes, written at
   `position` of every output record. */
typedef struct {
    Py_buffer view;
    Py_ssize_t position, width, stride, rows;
} piece_t;

static void release_pieces(piece_t *pieces, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&pieces[i].view);
    PyMem_Free(pieces);
}

/* Records framed at a time by frame_rows: 128 records of a few hundred bytes stay in L2 between the passes. */
#define FRAME_BLOCK_ROWS 128

static PyObject *frame_rows(PyObject *self, PyObject *args) {
    PyObject *out_obj, *template_obj, *pieces_obj, *order_obj;
    if (!PyArg_ParseTuple(args, "OOOO", &out_obj, &template_obj, &pieces_obj, &order_obj)) return NULL;
    PyObject *seq = PySequence_Fast(pieces_obj, "pieces must be a sequence of (position, array) pairs");
    if (seq == NULL) return NULL;
    Py_ssize_t npieces = PySequence_Fast_GET_SIZE(seq);
    piece_t *pieces = PyMem_Calloc(npieces > 0 ? npieces : 1, sizeof(piece_t));
    Py_buffer out = {0}, tmpl = {0}, order = {0};
    int have_out = 0, have_tmpl = 0, have_order = 0, ok = 1;
    Py_ssize_t got = 0;
    if (pieces == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (; got < npieces && ok; got++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, got);
        PyObject *array;
        piece_t *p = &pieces[got];
        if (!PyArg_ParseTuple(item, "nO", &p->position, &array) ||
            PyObject_GetBuffer(array, &p->view, PyBUF_STRIDES) != 0) {
            PyErr_Format(PyExc_TypeError, "piece %zd must be (position, 2-D uint8 array)", got);
            ok = 0;
            break;
        }
        if (p->view.ndim != 2 || p->view.itemsize != 1 || p->view.strides[1] != 1 || p->view.strides[0] < 0) {
            PyErr_Format(PyExc_ValueError, "piece %zd must be a 2-D uint8 array with contiguous rows", got);
            ok = 0;
            got++;
            break;
        }
        p->rows = p->view.shape[0];
        p->width = p->view.shape[1];
        p->stride = p->view.strides[0];
    }
    Py_DECREF(seq);
    if (ok && get_buffer(out_obj, &out, 1, "out") == 0) have_out = 1; else ok = 0;
    if (ok && get_buffer(template_obj, &tmpl, 0, "template") == 0) have_tmpl = 1; else ok = 0;
    if (ok && order_obj != Py_None) {
        if (get_buffer(order_obj, &order, 0, "order") == 0) have_order = 1; else ok = 0;
        if (ok && order.itemsize != 8) {
            PyErr_SetString(PyExc_TypeError, "order must be an int64 array");
            ok = 0;
        }
    }
    Py_ssize_t width = have_tmpl ? tmpl.len : 0, rows = 0;
    if (ok && width < 16) {
        PyErr_Format(PyExc_ValueError, "template of %zd bytes is under the 16 bytes of framing", width);
        ok = 0;
    }
    if (ok && out.len % width != 0) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes, not a whole number of %zd-byte records", out.len, width);
        ok = 0;
    }
    if (ok) {
        rows = out.len / width;
        if (have_order && order.len / 8 != rows) {
            PyErr_Format(PyExc_ValueError, "order has %zd entries for %zd output records", order.len / 8, rows);
            ok = 0;
        }
    }
    Py_ssize_t source_rows = npieces ? pieces[0].rows : rows;
    for (Py_ssize_t i = 0; i < npieces && ok; i++) {
        piece_t *p = &pieces[i];
        if (p->position < 12 || p->position + p->width > width - 4) {
            PyErr_Format(PyExc_ValueError, "piece %zd spans [%zd, %zd) outside the payload [12, %zd)", i, p->position,
                         p->position + p->width, width - 4);
            ok = 0;
        } else if (p->rows != source_rows) {
            PyErr_Format(PyExc_ValueError, "piece %zd has %zd rows, piece 0 has %zd", i, p->rows, source_rows);
            ok = 0;
        }
    }
    const int64_t *index = have_order ? (const int64_t *)order.buf : NULL;
    if (ok && index == NULL && source_rows != rows) {
        PyErr_Format(PyExc_ValueError, "the pieces have %zd rows for %zd output records", source_rows, rows);
        ok = 0;
    }
    for (Py_ssize_t j = 0; index != NULL && j < rows && ok; j++) {
        if (index[j] < 0 || index[j] >= source_rows) {
            PyErr_Format(PyExc_IndexError, "order[%zd] = %lld is outside the %zd source rows", j, (long long)index[j],
                         source_rows);
            ok = 0;
        }
    }
    if (ok) {
        uint8_t *base = (uint8_t *)out.buf;
        const uint8_t *row_template = (const uint8_t *)tmpl.buf;
        Py_BEGIN_ALLOW_THREADS
        /* Column by column within a block of rows that stays in cache: each column's copy is one tight loop of
           a constant size (a row of 33 float columns cost 33 calls of memcpy of a runtime size, row by row). */
        for (Py_ssize_t first = 0; first < rows; first += FRAME_BLOCK_ROWS) {
            const Py_ssize_t last = first + FRAME_BLOCK_ROWS < rows ? first + FRAME_BLOCK_ROWS : rows;
            for (Py_ssize_t j = first; j < last; j++) memcpy(base + j * width, row_template, (size_t)width);
            for (Py_ssize_t i = 0; i < npieces; i++) {
                const piece_t *p = &pieces[i];
                const uint8_t *column = (const uint8_t *)p->view.buf;
                uint8_t *to = base + p->position;
#define COPY_COLUMN(SIZE)                                                                                  \
    for (Py_ssize_t j = first; j < last; j++)                                                              \
        memcpy(to + j * width, column + (index ? index[j] : j) * p->stride, SIZE)
                switch (p->width) {
                    case 1: COPY_COLUMN(1); break;
                    case 4: COPY_COLUMN(4); break;
                    case 8: COPY_COLUMN(8); break;
                    default: COPY_COLUMN((size_t)p->width);
                }
#undef COPY_COLUMN
            }
            for (Py_ssize_t j = first; j < last; j++) {
                uint8_t *record = base + j * width;
                put_masked(record + width - 4, crc32c(record + 12, (size_t)(width - 16)));
            }
        }
        Py_END_ALLOW_THREADS
    }
    if (have_order) PyBuffer_Release(&order);
    if (have_tmpl) PyBuffer_Release(&tmpl);
    if (have_out) PyBuffer_Release(&out);
    release_pieces(pieces, got);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static inline uint64_t mix(uint64_t h) {
    h ^= h >> 30;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 27;
    h *= 0x94D049BB133111EBull;
    h ^= h >> 31;
    return h;
}

/* One column's words of every row: uint64, or uint32 zero-extended (a float32 column of odd width). */
#define FOLD_ROWS(WORD_T)                                                                              \
    do {                                                                                               \
        const WORD_T *w = (const WORD_T *)words.buf;                                                   \
        Py_ssize_t r = 0;                                                                              \
        for (; r + 8 <= rows; r += 8) {                                                                \
            uint64_t v[8];                                                                             \
            for (int i = 0; i < 8; i++) v[i] = has_name ? mix(hv[r + i] ^ name) : hv[r + i];         \
            for (Py_ssize_t j = 0; j < k; j++)                                                         \
                for (int i = 0; i < 8; i++) v[i] = mix(v[i] ^ (uint64_t)w[(r + i) * k + j]);           \
            for (int i = 0; i < 8; i++) hv[r + i] = v[i];                                              \
        }                                                                                              \
        for (; r < rows; r++) {                                                                        \
            uint64_t value = has_name ? mix(hv[r] ^ name) : hv[r];                                     \
            const WORD_T *row = w + r * k;                                                             \
            for (Py_ssize_t j = 0; j < k; j++) value = mix(value ^ (uint64_t)row[j]);                  \
            hv[r] = value;                                                                             \
        }                                                                                              \
    } while (0)

/* Each row's fold is one chain of dependent multiplies; eight rows at a time keep eight chains in flight, which
   GCC turns into one AVX-512 vector (64-bit lanes, vpmullq) in the clone it builds for x86-64-v4 CPUs: a quarter
   less time where the CPU has it, the same hashes everywhere (the loader picks the clone at run time). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define FOLD_CLONES __attribute__((target_clones("arch=x86-64-v4", "default")))
#else
#define FOLD_CLONES
#endif
FOLD_CLONES static void fold_rows_64(uint64_t *hv, const Py_buffer *wb, Py_ssize_t rows, Py_ssize_t k, int has_name,
                                     uint64_t name) {
    const Py_buffer words = *wb;
    FOLD_ROWS(uint64_t);
}
FOLD_CLONES static void fold_rows_32(uint64_t *hv, const Py_buffer *wb, Py_ssize_t rows, Py_ssize_t k, int has_name,
                                     uint64_t name) {
    const Py_buffer words = *wb;
    FOLD_ROWS(uint32_t);
}

static PyObject *split_hash(PyObject *self, PyObject *args) {
    PyObject *h_obj, *words_obj, *name_obj = Py_None;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "OOn|O", &h_obj, &words_obj, &k, &name_obj)) return NULL;
    int has_name = name_obj != Py_None;
    uint64_t name = 0;
    if (has_name) {
        name = PyLong_AsUnsignedLongLong(name_obj);
        if (PyErr_Occurred()) return NULL;
    }
    Py_buffer h, words;
    if (get_buffer(h_obj, &h, 1, "h") != 0) return NULL;
    if (get_buffer(words_obj, &words, 0, "words") != 0) {
        PyBuffer_Release(&h);
        return NULL;
    }
    Py_ssize_t rows = h.len / 8;
    if (h.itemsize != 8 || (words.itemsize != 8 && words.itemsize != 4) || k < 1 ||
        words.len != rows * k * words.itemsize) {
        PyBuffer_Release(&h);
        PyBuffer_Release(&words);
        return PyErr_Format(PyExc_ValueError, "split_hash needs uint64 h (rows) and uint64 or uint32 words (rows x %zd)",
                            k);
    }
    uint64_t *hv = (uint64_t *)h.buf;
    Py_BEGIN_ALLOW_THREADS
    if (words.itemsize == 8)
        fold_rows_64(hv, &words, rows, k, has_name, name);
    else
        fold_rows_32(hv, &words, rows, k, has_name, name);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&h);
    PyBuffer_Release(&words);
    Py_RETURN_NONE;
}

static PyObject *crc32c_value(PyObject *self, PyObject *args) {
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
    uint32_t crc = crc32c((const uint8_t *)data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *string_words(PyObject *self, PyObject *args) {
    Py_buffer data, starts, lengths, out;
    if (!PyArg_ParseTuple(args, "y*y*y*w*", &data, &starts, &lengths, &out)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t n = starts.len / 8;
    const int64_t *start = starts.buf, *length = lengths.buf;
    if (starts.len != n * 8 || lengths.len != n * 8 || out.len != n * 8) {
        PyErr_SetString(PyExc_ValueError, "starts, lengths and out must hold one 8-byte value per string each");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (start[i] < 0 || length[i] < 0 || start[i] + length[i] > data.len) {
            PyErr_Format(PyExc_ValueError, "string %zd (%lld bytes at %lld) is not inside the %zd bytes of data", i,
                         (long long)length[i], (long long)start[i], data.len);
            goto done;
        }
    Py_BEGIN_ALLOW_THREADS
    uint64_t *words = out.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        words[i] = crc32c((const uint8_t *)data.buf + start[i], (size_t)length[i]) | ((uint64_t)length[i] << 32);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *start_writeback(PyObject *self, PyObject *args) {
    int fd;
    long long offset, nbytes;
    if (!PyArg_ParseTuple(args, "iLL", &fd, &offset, &nbytes)) return NULL;
    if (offset < 0 || nbytes < 0)
        return PyErr_Format(PyExc_ValueError, "offset %lld and length %lld must not be negative", offset, nbytes);
#ifdef __linux__
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sync_file_range(fd, (off64_t)offset, (off64_t)nbytes, SYNC_FILE_RANGE_WRITE);
    Py_END_ALLOW_THREADS
    if (rc != 0) return PyErr_SetFromErrno(PyExc_OSError);
#endif
    Py_RETURN_NONE;
}

/* _native_statistics.c: its AVX-512 loop for float32 values, where built and the CPU has it */
void choose_vector_statistics(int on);
int vector_statistics_on(void);
PyObject *statistics_loop(PyObject *self, PyObject *unused);
PyObject *numeric_statistics(PyObject *self, PyObject *args);
/* _native_csv.c */
PyObject *parse_csv_block(PyObject *self, PyObject *args);
PyObject *csv_record_ends(PyObject *self, PyObject *args);

static PyObject *crc_loop(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(have_sse42 ? "hardware" : "table");
}

static PyObject *use_hardware(PyObject *self, PyObject *args) {
    int flag;
    if (!PyArg_ParseTuple(args, "p", &flag)) return NULL;
    int before = have_sse42 || vector_statistics_on();
#ifdef TFDAG_X86
    have_sse42 = flag && __builtin_cpu_supports("sse4.2");
#endif
    choose_vector_statistics(flag);
    return PyBool_FromLong(before);
}

static PyMethodDef methods[] = {
    {"use_hardware", use_hardware, METH_VARARGS,
     "use_hardware(flag): use the CPU's CRC32C instruction and the statistics' AVX-512 loop where it has them (False: the "
     "portable loops); returns the old setting"},
    {"frame_rows", frame_rows, METH_VARARGS,
     "frame_rows(out, template, pieces, order): fill fixed-width records from a template and columns, then frame them"},
    {"frame_offsets", frame_offsets, METH_VARARGS, "frame_offsets(data, offsets): write the payload CRC of each record"},
    {"split_hash", split_hash, METH_VARARGS,
     "split_hash(h, words, k, name=None): fold the word `name` (when given), then k uint64 or uint32 words per row, into h"},
    {"string_words", string_words, METH_VARARGS,
     "string_words(data, starts, lengths, out): out[i] = crc32c(data[starts[i]:][:lengths[i]]) | lengths[i] << 32"},
    {"start_writeback", start_writeback, METH_VARARGS,
     "start_writeback(fd, offset, nbytes): start writing a byte range of a file to its device (no wait)"},
    {"crc32c", crc32c_value, METH_VARARGS, "crc32c(data): the (unmasked) CRC32C of a buffer"},
    {"crc_loop", crc_loop, METH_NOARGS, "crc_loop(): the loop CRC32C takes now, 'hardware' (SSE 4.2) or 'table'"},
    {"statistics_loop", statistics_loop, METH_NOARGS,
     "statistics_loop(): the loop numeric_statistics runs for float32 values now, 'AVX-512' or 'portable'"},
    {"numeric_statistics", numeric_statistics, METH_VARARGS,
     "numeric_statistics(values, split, train_keys, eval_keys, shift): per split (count, missing, mean, m2, min, max)"},
    {"parse_csv_block", parse_csv_block, METH_VARARGS,
     "parse_csv_block(text, delimiter, kinds, outputs, num_lines): plain CSV lines into typed columns; False if not plain"},
    {"csv_record_ends", csv_record_ends, METH_VARARGS,
     "csv_record_ends(text, delimiter, quote, start, state, limit): (int64 ends of the records, the scan's state)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    init_tables();
#ifdef TFDAG_X86
    __builtin_cpu_init();
    have_sse42 = !!__builtin_cpu_supports("sse4.2");
#endif
    choose_vector_statistics(1);
    PyObject *m = PyModule_Create(&module);
    /* 2: split_hash takes the column's name word and uint32 words (an extension built before takes neither). */
    if (m != NULL) PyModule_AddIntConstant(m, "split_hash_version", 2);
    return m;
}
