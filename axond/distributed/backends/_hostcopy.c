/* Large host copies with x86's `rep movsb` (see host_copy.large_copy), copies into shared memory that skip what
 * the destination already holds (host_copy.copy_changed), and copies with non-temporal stores into memory that this
 * process does not read again soon (host_copy.stream_copy).
 *
 * On this project's AMD EPYC VM glibc's memcpy copies arrays of tens of MiB with its vector loop at about two
 * thirds of the speed `rep movsb` reaches (64 MiB: 3.4 against 5.6 ms between two cores), except at the page
 * distances where `rep movsb` itself is slow (host_copy.SLOW_DISTANCE): the caller picks. Elsewhere than x86-64
 * this is memcpy. The GIL is released during the copy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

static void copy_bytes(void *dst, const void *src, size_t n) {
#if defined(__x86_64__)
    __asm__ volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
#else
    memcpy(dst, src, n);
#endif
}

/* The (dst_address, src_address, nbytes) arguments of `name`; 0, or -1 with an exception set. */
static int parse_copy(const char *name, PyObject *const *args, Py_ssize_t nargs, void **dst, const void **src,
                      Py_ssize_t *n) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "%s(dst_address, src_address, nbytes) takes 3 integers", name);
        return -1;
    }
    *dst = PyLong_AsVoidPtr(args[0]);
    if (*dst == NULL && PyErr_Occurred())
        return -1;
    *src = PyLong_AsVoidPtr(args[1]);
    if (*src == NULL && PyErr_Occurred())
        return -1;
    *n = PyLong_AsSsize_t(args[2]);
    if (*n == -1 && PyErr_Occurred())
        return -1;
    if (*n < 0 || (*n > 0 && (*dst == NULL || *src == NULL))) {
        PyErr_Format(PyExc_ValueError, "%s: nbytes must be >= 0 and the addresses non-null", name);
        return -1;
    }
    return 0;
}

static PyObject *hostcopy_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    void *dst;
    const void *src;
    Py_ssize_t n;
    if (parse_copy("copy", args, nargs, &dst, &src, &n) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    copy_bytes(dst, src, (size_t)n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* dst <- src with non-temporal (streaming) stores where the CPU has them: the destination's lines are written to
 * memory without being read into the cache first, and without evicting what the process works on. glibc's memcpy
 * switches to such stores only above a threshold derived from the last-level cache it is told of (190 MB on this
 * project's VM, which reports a 480 MiB L3), so a copy of tens of MB into memory nobody reads soon (a snapshot) goes
 * through the cache: a read of every destination line, then its write-back. SSE2 (every x86-64): 64 bytes a turn,
 * unaligned loads, the destination aligned to 16 bytes first; the fence makes the stores visible before return. */
#if defined(__x86_64__)
#define STREAM_PAGE 4096
/* 64 bytes from `src` to `dst` (16-byte aligned) with streaming stores. */
static inline void stream_line(char *dst, const char *src) {
    __m128i a = _mm_loadu_si128((const __m128i *)src);
    __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
    __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
    _mm_stream_si128((__m128i *)dst, a);
    _mm_stream_si128((__m128i *)(dst + 16), b);
    _mm_stream_si128((__m128i *)(dst + 32), c);
    _mm_stream_si128((__m128i *)(dst + 48), d);
}
#endif

static void stream_bytes(char *dst, const char *src, size_t n) {
#if defined(__x86_64__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    /* four pages at a time, a line of each in turn (as glibc's large copy): four streams of reads keep more of the
     * memory's banks busy than one */
    size_t blocks = n / (4 * STREAM_PAGE) * (4 * STREAM_PAGE);
    for (size_t at = 0; at < blocks; at += 4 * STREAM_PAGE) {
        for (size_t line = 0; line < STREAM_PAGE; line += 64) {
            stream_line(dst + at + line, src + at + line);
            stream_line(dst + at + STREAM_PAGE + line, src + at + STREAM_PAGE + line);
            stream_line(dst + at + 2 * STREAM_PAGE + line, src + at + 2 * STREAM_PAGE + line);
            stream_line(dst + at + 3 * STREAM_PAGE + line, src + at + 3 * STREAM_PAGE + line);
        }
    }
    size_t body = blocks + ((n - blocks) & ~(size_t)63);
    for (size_t at = blocks; at < body; at += 64)
        stream_line(dst + at, src + at);
    memcpy(dst + body, src + body, n - body);
    _mm_sfence();
#else
    memcpy(dst, src, n);
#endif
}

static PyObject *hostcopy_stream(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    void *dst;
    const void *src;
    Py_ssize_t n;
    if (parse_copy("stream", args, nargs, &dst, &src, &n) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    stream_bytes(dst, src, (size_t)n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

#define SAME_BLOCK 4096

/* dst <- src (n bytes), skipping the SAME_BLOCK blocks dst already holds up to the first that differs, then copying
 * the rest at once; the bytes written. Where the data changed, the first block differs at its first bytes in the
 * common case, so a copy of new data costs one comparison of a few bytes (each comparison may fetch a line another
 * core holds). */
static size_t copy_changed_bytes(char *dst, const char *src, size_t n) {
    for (size_t at = 0; at < n; at += SAME_BLOCK) {
        size_t take = n - at < SAME_BLOCK ? n - at : SAME_BLOCK;
        if (memcmp(dst + at, src + at, take) != 0) {
            memcpy(dst + at, src + at, n - at);
            return n - at;
        }
    }
    return 0;
}

static PyObject *hostcopy_copy_changed(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    void *dst;
    const void *src;
    Py_ssize_t n;
    if (parse_copy("copy_changed", args, nargs, &dst, &src, &n) < 0)
        return NULL;
    size_t written;
    Py_BEGIN_ALLOW_THREADS
    written = copy_changed_bytes(dst, src, (size_t)n);
    Py_END_ALLOW_THREADS
    return PyLong_FromSize_t(written);
}

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))hostcopy_copy, METH_FASTCALL,
     "copy(dst_address, src_address, nbytes): copy nbytes bytes with rep movsb (memcpy off x86-64), without the GIL."},
    {"copy_changed", (PyCFunction)(void (*)(void))hostcopy_copy_changed, METH_FASTCALL,
     "copy_changed(dst_address, src_address, nbytes): copy from the first 4 KiB block that differs, without the "
     "GIL; the bytes written."},
    {"stream", (PyCFunction)(void (*)(void))hostcopy_stream, METH_FASTCALL,
     "stream(dst_address, src_address, nbytes): copy nbytes bytes with non-temporal stores (memcpy off x86-64), "
     "without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_hostcopy",
    .m_doc = "Large host copies with rep movsb (see host_copy.large_copy).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__hostcopy(void) { return PyModule_Create(&module); }
