/* Native loops of the conversion fast path: TFRecord CRCs and the split hash, one C loop over all rows.

   Python would pay one call per record for each (about 0.5 us: as much as encoding the record). Both
   functions take buffers (numpy arrays), write their results in place, and release the GIL, so the writer
   threads run beside them. `pipeline_lib.encoding` and `pipeline_lib.conversion` keep a pure-Python path that
   gives the same bytes and is used when this module is not built (a test compares the two).

   frame_fixed(data, width)      records of `width` bytes back to back: u64 length | u32 masked crc(length) |
                                 payload | u32 masked crc(payload). Writes the last field of every record.
   frame_offsets(data, offsets)  the same for records of any size, record i = data[offsets[i]:offsets[i+1]].
   use_hardware(flag)            switch between the CPU's crc32 instruction and the table loop (for tests).
   split_hash(h, words, k)       for each row r: for each of its k uint64 words w: h[r] ^= w; h[r] = mix(h[r]),
                                 mix being splitmix64's finalizer (the numpy loop in conversion.split_hash).
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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

static PyObject *frame_fixed(PyObject *self, PyObject *args) {
    PyObject *data_obj;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "On", &data_obj, &width)) return NULL;
    if (width < 16) return PyErr_Format(PyExc_ValueError, "record width %zd is under the 16 bytes of framing", width);
    Py_buffer data;
    if (get_buffer(data_obj, &data, 1, "data") != 0) return NULL;
    if (data.len % width != 0) {
        PyBuffer_Release(&data);
        return PyErr_Format(PyExc_ValueError, "data holds %zd bytes, not a whole number of %zd-byte records",
                            data.len, width);
    }
    uint8_t *base = (uint8_t *)data.buf;
    Py_ssize_t rows = data.len / width;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < rows; i++) {
        uint8_t *record = base + i * width;
        put_masked(record + width - 4, crc32c(record + 12, (size_t)(width - 16)));
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    Py_RETURN_NONE;
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

static inline uint64_t mix(uint64_t h) {
    h ^= h >> 30;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 27;
    h *= 0x94D049BB133111EBull;
    h ^= h >> 31;
    return h;
}

static PyObject *split_hash(PyObject *self, PyObject *args) {
    PyObject *h_obj, *words_obj;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "OOn", &h_obj, &words_obj, &k)) return NULL;
    Py_buffer h, words;
    if (get_buffer(h_obj, &h, 1, "h") != 0) return NULL;
    if (get_buffer(words_obj, &words, 0, "words") != 0) {
        PyBuffer_Release(&h);
        return NULL;
    }
    Py_ssize_t rows = h.len / 8;
    if (h.itemsize != 8 || words.itemsize != 8 || k < 1 || words.len != rows * k * 8) {
        PyBuffer_Release(&h);
        PyBuffer_Release(&words);
        return PyErr_Format(PyExc_ValueError, "split_hash needs uint64 h (rows) and words (rows x %zd)", k);
    }
    uint64_t *hv = (uint64_t *)h.buf;
    const uint64_t *w = (const uint64_t *)words.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows; r++) {
        uint64_t value = hv[r];
        const uint64_t *row = w + r * k;
        for (Py_ssize_t j = 0; j < k; j++) value = mix(value ^ row[j]);
        hv[r] = value;
    }
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

static PyObject *use_hardware(PyObject *self, PyObject *args) {
    int flag;
    if (!PyArg_ParseTuple(args, "p", &flag)) return NULL;
    int before = have_sse42;
#ifdef TFDAG_X86
    have_sse42 = flag && __builtin_cpu_supports("sse4.2");
#endif
    return PyBool_FromLong(before);
}

static PyMethodDef methods[] = {
    {"use_hardware", use_hardware, METH_VARARGS,
     "use_hardware(flag): use the CPU's CRC32C instruction when it has one (False: the table loop); returns the old setting"},
    {"frame_fixed", frame_fixed, METH_VARARGS, "frame_fixed(data, width): write the payload CRC of fixed-width records"},
    {"frame_offsets", frame_offsets, METH_VARARGS, "frame_offsets(data, offsets): write the payload CRC of each record"},
    {"split_hash", split_hash, METH_VARARGS, "split_hash(h, words, k): fold k uint64 words per row into h"},
    {"crc32c", crc32c_value, METH_VARARGS, "crc32c(data): the (unmasked) CRC32C of a buffer"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    init_tables();
#ifdef TFDAG_X86
    __builtin_cpu_init();
    have_sse42 = !!__builtin_cpu_supports("sse4.2");
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL) PyModule_AddIntConstant(m, "hardware_crc", have_sse42);
    return m;
}
