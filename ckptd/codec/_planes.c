/* Byte-plane split and merge, sign rotation and exponent nibbles, compiled.
 *
 * The same transforms as ckptd/codec/planes.py and nibbles.py (the reference, and the fallback
 * when this module is absent), byte for byte; docs/FORMAT.md, "Planes" and "Exponent nibbles".
 * Only the Python C API and the buffer protocol: building needs a C compiler and Python's
 * headers, nothing else. Every length comes from a buffer checked here; outputs may not
 * overlap each other or any input. The loops run without the GIL and are plain C that the
 * compiler vectorises (-O3), so one build runs on any x86-64 or aarch64.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if !PY_LITTLE_ENDIAN
#error "the plane kernels assume little-endian elements; the numpy path serves other machines"
#endif

#define MAX_WIDTH 8
#define CHUNK 4096 /* elements per pass of the nibble kernels; even, and fits in L1 */
#define INLINE static inline __attribute__((always_inline))

/* The four loops are also compiled for AVX2 and picked at load time (an ifunc, glibc and gcc
 * on x86-64 only): 1.4x on the nibble merge and split, measured in docs/PERFORMANCE.md.
 * Everywhere else, and on x86-64 without AVX2, the baseline build runs. */
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__GNUC__) && !defined(__clang__) &&       \
    !defined(CKPTD_NO_CLONES)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

typedef struct { Py_buffer views[2 * MAX_WIDTH + 4]; int held; } Buffers; /* the ones held */

static void release(Buffers *b) {
    for (int i = 0; i < b->held; i++)
        PyBuffer_Release(&b->views[i]);
    b->held = 0;
}

static Py_buffer *take(Buffers *b, PyObject *obj, int writable) {
    Py_buffer *view = &b->views[b->held];
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return NULL;
    b->held++;
    return view;
}

/* Each buffer of `seq` (exactly `n` of them), every one `len` bytes long. */
static int take_all(Buffers *b, PyObject *seq, Py_ssize_t n, Py_ssize_t len, int writable,
                    uint8_t **ptrs, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd planes, expected %zd", what,
                     PySequence_Fast_GET_SIZE(fast), n);
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_buffer *view = take(b, PySequence_Fast_GET_ITEM(fast, i), writable);
        if (view == NULL) {
            Py_DECREF(fast);
            return -1;
        }
        if (len >= 0 && view->len != len) {
            PyErr_Format(PyExc_ValueError, "%s: plane %zd holds %zd bytes, expected %zd", what,
                         i, view->len, len);
            Py_DECREF(fast);
            return -1;
        }
        ptrs[i] = view->buf;
    }
    Py_DECREF(fast);
    return 0;
}

/* ValueError unless each written buffer (views[first..first + count)) overlaps no other
 * buffer held. */
static int disjoint(Buffers *b, int first, int count) {
    for (int i = first; i < first + count && i < b->held; i++) {
        const char *a = b->views[i].buf;
        for (int j = 0; j < b->held; j++) {
            const char *c = b->views[j].buf;
            if (i == j || b->views[i].len == 0 || b->views[j].len == 0)
                continue;
            if (a < c + b->views[j].len && c < a + b->views[i].len) {
                PyErr_SetString(PyExc_ValueError, "output buffers overlap an input or each other");
                return -1;
            }
        }
    }
    return 0;
}

static int check_width(int width) {
    if (width != 2 && width != 4 && width != 8)
        PyErr_Format(PyExc_ValueError, "width %d: the kernels take 2, 4 or 8", width);
    return width != 2 && width != 4 && width != 8 ? -1 : 0;
}

INLINE uint16_t rotl1(uint16_t t) { return (uint16_t)((t << 1) | (t >> 15)); }
INLINE uint16_t rotr1(uint16_t t) { return (uint16_t)((t >> 1) | (t << 15)); }

/* ---- split: elements into planes (plane i = byte i; the top two bytes rotated) ---- */

/* Pointers copied into restrict locals: stores through uint8_t may alias anything, so without
 * them the compiler reloads every plane pointer per element and vectorises nothing. */
#define PLANES(p)                                                                              \
    uint8_t *restrict p0 = p[0], *restrict p1 = p[1], *restrict p2 = p[w > 2 ? 2 : 0],         \
                      *restrict p3 = p[w > 2 ? 3 : 0], *restrict p4 = p[w > 4 ? 4 : 0],        \
                      *restrict p5 = p[w > 4 ? 5 : 0], *restrict p6 = p[w > 4 ? 6 : 0],        \
                      *restrict p7 = p[w > 4 ? 7 : 0]

INLINE void split_w(const uint8_t *restrict src, uint8_t *const *p, Py_ssize_t n, const int w,
                    const int rot) {
    PLANES(p);
    for (Py_ssize_t k = 0; k < n; k++) {
        uint16_t t;
        if (w == 2) {
            memcpy(&t, src + 2 * k, 2);
        } else if (w == 4) {
            uint32_t v;
            memcpy(&v, src + 4 * k, 4);
            p0[k] = (uint8_t)v, p1[k] = (uint8_t)(v >> 8);
            t = (uint16_t)(v >> 16);
        } else {
            uint64_t v;
            memcpy(&v, src + 8 * k, 8);
            p0[k] = (uint8_t)v, p1[k] = (uint8_t)(v >> 8), p2[k] = (uint8_t)(v >> 16);
            p3[k] = (uint8_t)(v >> 24), p4[k] = (uint8_t)(v >> 32), p5[k] = (uint8_t)(v >> 40);
            t = (uint16_t)(v >> 48);
        }
        if (rot)
            t = rotl1(t);
        uint8_t *restrict lo = w == 2 ? p0 : w == 4 ? p2 : p6;
        uint8_t *restrict hi = w == 2 ? p1 : w == 4 ? p3 : p7;
        lo[k] = (uint8_t)t;
        hi[k] = (uint8_t)(t >> 8);
    }
}

CLONES static void split_any(const uint8_t *src, uint8_t *const *p, Py_ssize_t n, int w,
                             int rot) {
    if (w == 2)
        rot ? split_w(src, p, n, 2, 1) : split_w(src, p, n, 2, 0);
    else if (w == 4)
        rot ? split_w(src, p, n, 4, 1) : split_w(src, p, n, 4, 0);
    else
        rot ? split_w(src, p, n, 8, 1) : split_w(src, p, n, 8, 0);
}

/* ---- merge: planes into elements ---- */

INLINE void merge_w(uint8_t *const *p, uint8_t *restrict out, Py_ssize_t n, const int w,
                    const int rot) {
    PLANES(p);
    const uint8_t *restrict lo = w == 2 ? p0 : w == 4 ? p2 : p6;
    const uint8_t *restrict hi = w == 2 ? p1 : w == 4 ? p3 : p7;
    for (Py_ssize_t k = 0; k < n; k++) {
        uint16_t t = (uint16_t)(lo[k] | (hi[k] << 8));
        if (rot)
            t = rotr1(t);
        if (w == 2) {
            memcpy(out + 2 * k, &t, 2);
        } else if (w == 4) {
            uint32_t x = (uint32_t)t << 16 | (uint32_t)p1[k] << 8 | p0[k];
            memcpy(out + 4 * k, &x, 4);
        } else {
            uint64_t x = (uint64_t)t << 48 | (uint64_t)p5[k] << 40 | (uint64_t)p4[k] << 32 |
                         (uint64_t)p3[k] << 24 | (uint64_t)p2[k] << 16 | (uint64_t)p1[k] << 8 |
                         p0[k];
            memcpy(out + 8 * k, &x, 8);
        }
    }
}

CLONES static void merge_any(uint8_t *const *p, uint8_t *out, Py_ssize_t n, int w,
                             int rot) {
    if (w == 2)
        rot ? merge_w(p, out, n, 2, 1) : merge_w(p, out, n, 2, 0);
    else if (w == 4)
        rot ? merge_w(p, out, n, 4, 1) : merge_w(p, out, n, 4, 0);
    else
        rot ? merge_w(p, out, n, 8, 1) : merge_w(p, out, n, 8, 0);
}

/* ---- exponent nibbles ---- */
/* Nibbles of `top[0..n)` into pairs (n even, or the last high nibble 0); escaped values are
 * appended to `esc` at `*nesc`. */
CLONES static void pack_chunk(const uint8_t *restrict top, Py_ssize_t n, uint8_t base,
                              uint8_t *restrict pairs, uint8_t *restrict esc,
                              Py_ssize_t *nesc) {
    uint8_t nib[CHUNK + 8];
    uint8_t hit = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        uint8_t d = (uint8_t)(top[k] - base);
        hit |= d >= 15;
        nib[k] = d < 15 ? d : 15;
    }
    if (hit) { /* 8 nibbles (one a byte, each <= 15) at a time: a byte + 1 reaches 16 at 15 */
        memset(nib + n, 0, 8);
        for (Py_ssize_t k = 0; k < n; k += 8) {
            uint64_t x;
            memcpy(&x, nib + k, 8);
            if ((x + 0x0101010101010101ULL) & 0x1010101010101010ULL) {
                for (Py_ssize_t i = k; i < k + 8 && i < n; i++)
                    if (nib[i] == 15)
                        esc[(*nesc)++] = top[i];
            }
        }
    }
    nib[n] = 0;
    for (Py_ssize_t j = 0; j < (n + 1) / 2; j++)
        pairs[j] = (uint8_t)(nib[2 * j] | (nib[2 * j + 1] << 4));
}

/* The top plane's bytes `top[0..n)` from pairs (the i-th 15 met takes esc[i] while the list
 * lasts); returns the 15s met. */
CLONES static Py_ssize_t unpack_chunk(const uint8_t *restrict pairs, Py_ssize_t n,
                                      uint8_t base, uint8_t *restrict top,
                                      const uint8_t *restrict esc, Py_ssize_t nesc,
                                      Py_ssize_t marks) {
    Py_ssize_t npairs = n / 2;
    uint16_t spread = (uint16_t)(base * 0x0101);
    for (Py_ssize_t j = 0; j < npairs; j++) {
        uint16_t x = (uint16_t)((pairs[j] & 0x0F) | ((pairs[j] & 0xF0) << 4)) + spread;
        memcpy(top + 2 * j, &x, 2);
    }
    if (n & 1)
        top[n - 1] = (uint8_t)(base + (pairs[npairs] & 0x0F));
    if (nesc == 0)
        return 0; /* a stray 15 decodes to base + 15; the block checksum rejects it */
    /* 128 nibbles at a time, 16 per word: bit 3 of (x & 7) + 1, and of x, is set only at a
     * nibble of 15; a block of pairs with one is then read nibble by nibble. */
    Py_ssize_t met = 0, npairs_all = (n + 1) / 2;
    for (Py_ssize_t j = 0; j < npairs_all; j += 64) {
        if (npairs_all - j >= 64) {
            uint64_t acc = 0;
            for (int i = 0; i < 8; i++) {
                uint64_t x;
                memcpy(&x, pairs + j + 8 * i, 8);
                acc |= ((x & 0x7777777777777777ULL) + 0x1111111111111111ULL) & x;
            }
            if (!(acc & 0x8888888888888888ULL))
                continue;
        }
        Py_ssize_t stop = 2 * j + 128 < n ? 2 * j + 128 : n;
        for (Py_ssize_t k = 2 * j; k < stop; k++) {
            uint8_t nib = (k & 1) ? pairs[k >> 1] >> 4 : pairs[k >> 1] & 0x0F;
            if (nib == 15) {
                if (marks + met < nesc)
                    top[k] = esc[marks + met];
                met++;
            }
        }
    }
    return met;
}

/* Whole buffers, a chunk at a time, the top plane of each chunk held in `top` (in L1). */

static Py_ssize_t pack_all(const uint8_t *top, Py_ssize_t n, uint8_t base, uint8_t *pairs,
                           uint8_t *esc) {
    Py_ssize_t nesc = 0;
    for (Py_ssize_t at = 0; at < n; at += CHUNK)
        pack_chunk(top + at, n - at < CHUNK ? n - at : CHUNK, base, pairs + at / 2, esc, &nesc);
    return nesc;
}

static Py_ssize_t split_packed_all(const uint8_t *src, uint8_t *const *p, Py_ssize_t n, int w,
                                   uint8_t base, uint8_t *pairs, uint8_t *esc) {
    uint8_t top[CHUNK], *q[MAX_WIDTH];
    Py_ssize_t nesc = 0;
    for (Py_ssize_t at = 0; at < n; at += CHUNK) {
        Py_ssize_t m = n - at < CHUNK ? n - at : CHUNK;
        for (int i = 0; i < w - 1; i++)
            q[i] = p[i] + at;
        q[w - 1] = top;
        split_any(src + at * w, q, m, w, 1);
        pack_chunk(top, m, base, pairs + at / 2, esc, &nesc);
    }
    return nesc;
}

static Py_ssize_t merge_nibbles_all(uint8_t *const *p, const uint8_t *pairs, uint8_t base,
                                    const uint8_t *esc, Py_ssize_t nesc, int w, int rot,
                                    uint8_t *out, Py_ssize_t n) {
    uint8_t top[CHUNK], *q[MAX_WIDTH];
    Py_ssize_t marks = 0;
    for (Py_ssize_t at = 0; at < n; at += CHUNK) {
        Py_ssize_t m = n - at < CHUNK ? n - at : CHUNK;
        marks += unpack_chunk(pairs + at / 2, m, base, top, esc, nesc, marks);
        for (int i = 0; i < w - 1; i++)
            q[i] = p[i] + at;
        q[w - 1] = top;
        merge_any(q, out + at * w, m, w, rot);
    }
    return marks;
}

/* ---- Python entry points: arguments checked, the loops run without the GIL ---- */

PyDoc_STRVAR(split_doc, "split(src, width, rotate, planes): byte i of each of the "
                        "len(src) // width elements into planes[i], each exactly that long.");

static PyObject *py_split(PyObject *self, PyObject *args) {
    PyObject *src_obj, *seq;
    int width, rotate;
    Buffers b = {.held = 0};
    uint8_t *p[MAX_WIDTH];
    if (!PyArg_ParseTuple(args, "OipO", &src_obj, &width, &rotate, &seq) || check_width(width))
        return NULL;
    Py_buffer *src = take(&b, src_obj, 0);
    if (src == NULL || take_all(&b, seq, width, src->len / width, 1, p, "split") ||
        disjoint(&b, 1, width))
        return release(&b), NULL;
    PyThreadState *ts = PyEval_SaveThread();
    split_any(src->buf, p, src->len / width, width, rotate);
    PyEval_RestoreThread(ts);
    release(&b);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(merge_doc, "merge(planes, width, rotate, out): the inverse of split; `width` "
                        "planes of equal length, `out` exactly width times as long.");

static PyObject *py_merge(PyObject *self, PyObject *args) {
    PyObject *seq, *out_obj;
    int width, rotate;
    Buffers b = {.held = 0};
    uint8_t *p[MAX_WIDTH];
    if (!PyArg_ParseTuple(args, "OipO", &seq, &width, &rotate, &out_obj) || check_width(width))
        return NULL;
    Py_buffer *out = take(&b, out_obj, 1);
    if (out != NULL && out->len % width)
        PyErr_Format(PyExc_ValueError, "merge: output of %zd bytes for width %d", out->len,
                     width);
    if (out == NULL || PyErr_Occurred() ||
        take_all(&b, seq, width, out->len / width, 0, p, "merge") || disjoint(&b, 0, 1))
        return release(&b), NULL;
    PyThreadState *ts = PyEval_SaveThread();
    merge_any(p, out->buf, out->len / width, width, rotate);
    PyEval_RestoreThread(ts);
    release(&b);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(pack_doc, "pack_nibbles(top, base, pairs, escapes) -> count: `top` as exponent "
                       "nibbles into `pairs` ((len(top) + 1) // 2 bytes), the escaped values "
                       "into the start of `escapes` (at least len(top) bytes); how many.");

static PyObject *py_pack(PyObject *self, PyObject *args) {
    PyObject *top_obj, *pairs_obj, *esc_obj;
    int base;
    Buffers b = {.held = 0};
    if (!PyArg_ParseTuple(args, "OiOO", &top_obj, &base, &pairs_obj, &esc_obj))
        return NULL;
    Py_buffer *top = take(&b, top_obj, 0), *pairs = NULL, *esc = NULL;
    if (top == NULL || (pairs = take(&b, pairs_obj, 1)) == NULL ||
        (esc = take(&b, esc_obj, 1)) == NULL)
        return release(&b), NULL;
    Py_ssize_t n = top->len;
    if (base < 0 || base > 255 || pairs->len != (n + 1) / 2 || esc->len < n)
        PyErr_SetString(PyExc_ValueError, "pack_nibbles: base, pairs or escapes of a wrong size");
    if (PyErr_Occurred() || disjoint(&b, 1, 2))
        return release(&b), NULL;
    PyThreadState *ts = PyEval_SaveThread();
    Py_ssize_t nesc = pack_all(top->buf, n, (uint8_t)base, pairs->buf, esc->buf);
    PyEval_RestoreThread(ts);
    release(&b);
    return PyLong_FromSsize_t(nesc);
}

PyDoc_STRVAR(split_packed_doc, "split_packed(src, width, base, lower, pairs, escapes) -> count: "
                               "split(rotate=True) with the top plane packed as pack_nibbles "
                               "would; `lower` are the width - 1 planes below the top.");

static PyObject *py_split_packed(PyObject *self, PyObject *args) {
    PyObject *src_obj, *seq, *pairs_obj, *esc_obj;
    int width, base;
    Buffers b = {.held = 0};
    uint8_t *p[MAX_WIDTH];
    if (!PyArg_ParseTuple(args, "OiiOOO", &src_obj, &width, &base, &seq, &pairs_obj, &esc_obj) ||
        check_width(width))
        return NULL;
    Py_buffer *src = take(&b, src_obj, 0), *pairs = NULL, *esc = NULL;
    if (src == NULL || take_all(&b, seq, width - 1, src->len / width, 1, p, "split_packed") ||
        (pairs = take(&b, pairs_obj, 1)) == NULL || (esc = take(&b, esc_obj, 1)) == NULL)
        return release(&b), NULL;
    Py_ssize_t n = src->len / width;
    if (base < 0 || base > 255 || pairs->len != (n + 1) / 2 || esc->len < n)
        PyErr_SetString(PyExc_ValueError, "split_packed: base, pairs or escapes of a wrong size");
    if (PyErr_Occurred() || disjoint(&b, 1, width + 1))
        return release(&b), NULL;
    PyThreadState *ts = PyEval_SaveThread();
    Py_ssize_t nesc = split_packed_all(src->buf, p, n, width, (uint8_t)base, pairs->buf, esc->buf);
    PyEval_RestoreThread(ts);
    release(&b);
    return PyLong_FromSsize_t(nesc);
}

PyDoc_STRVAR(merge_nibbles_doc,
             "merge_nibbles(lower, pairs, base, escapes, width, rotate, out) -> marks: merge with "
             "the top plane unpacked from nibble pairs; the i-th 15 takes escapes[i] while the "
             "list lasts; returns the 15s met (a caller compares it with len(escapes)).");

static PyObject *py_merge_nibbles(PyObject *self, PyObject *args) {
    PyObject *seq, *pairs_obj, *esc_obj, *out_obj;
    int width, base, rotate;
    Buffers b = {.held = 0};
    uint8_t *p[MAX_WIDTH];
    if (!PyArg_ParseTuple(args, "OOiOipO", &seq, &pairs_obj, &base, &esc_obj, &width, &rotate,
                          &out_obj) ||
        check_width(width))
        return NULL;
    Py_buffer *out = take(&b, out_obj, 1), *pairs = NULL, *esc = NULL;
    Py_ssize_t n = out == NULL ? 0 : out->len / width;
    if (out == NULL || (pairs = take(&b, pairs_obj, 0)) == NULL ||
        (esc = take(&b, esc_obj, 0)) == NULL ||
        take_all(&b, seq, width - 1, n, 0, p, "merge_nibbles"))
        return release(&b), NULL;
    if (out->len % width || base < 0 || base > 255 || pairs->len != (n + 1) / 2)
        PyErr_SetString(PyExc_ValueError, "merge_nibbles: planes, pairs or output of a wrong size");
    if (PyErr_Occurred() || disjoint(&b, 0, 1))
        return release(&b), NULL;
    PyThreadState *ts = PyEval_SaveThread();
    Py_ssize_t marks = merge_nibbles_all(p, pairs->buf, (uint8_t)base, esc->buf, esc->len, width,
                                         rotate, out->buf, n);
    PyEval_RestoreThread(ts);
    release(&b);
    return PyLong_FromSsize_t(marks);
}

static PyMethodDef methods[] = {
    {"split", py_split, METH_VARARGS, split_doc},
    {"merge", py_merge, METH_VARARGS, merge_doc},
    {"pack_nibbles", py_pack, METH_VARARGS, pack_doc},
    {"split_packed", py_split_packed, METH_VARARGS, split_packed_doc},
    {"merge_nibbles", py_merge_nibbles, METH_VARARGS, merge_nibbles_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ckptd.codec._planes",
    "Byte-plane split and merge, sign rotation and exponent nibbles, compiled.", -1, methods,
};

PyMODINIT_FUNC PyInit__planes(void) { return PyModule_Create(&module); }
