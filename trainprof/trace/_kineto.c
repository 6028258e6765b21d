/* One pass over a Kineto (Chrome trace) JSON document into the columns trainprof reads.

   scan(buffer) -> None or a tuple (see the Python side, trainprof/trace/_document.py `_from_scan`).

   A fast path only: it returns None for anything it does not take exactly as the typed msgspec
   decoder (_document._DECODER) would — invalid JSON, an event of an unknown phase, a field of an
   unexpected type, an integer beyond int64, an escaped object key, a repeated key, nesting
   deeper than MAX_DEPTH — and the caller then decodes the document the usual way, which keeps
   every error message and the tolerant path. Every read is bounded by the buffer's end.

   What it keeps, per complete ('X') event: name, cat (factorized: codes + distinct values),
   pid, tid (int64; a string id comes back as an index into its distinct strings), ts, dur
   (float64, parsed with correct rounding), args' stream, correlation, External id (int64, -1
   when absent; the older traces' "external id" where "External id" is absent), the raw spans
   of Input Dims / Input type / Concrete Inputs and of a kernel's launch figures (grid, block,
   registers per thread, shared memory, blocks per SM, warps per SM, est. achieved occupancy %)
   (factorized by their bytes) and of the collective keys; per '[memory]' instant event its ts and integer fields;
   the spans of the top-level keys besides traceEvents. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* real traces nest a few levels; deeper documents go to the typed decoder, whose own limit is
   the interpreter's recursion budget left at the call */
#define MAX_DEPTH 64

typedef struct {
    const char *base, *p, *end;
} Cur;

typedef struct {
    const char *s;
    Py_ssize_t n;
} Span;

/* ------------------------------------------------------------------ growable arrays */
typedef struct {
    char *data;
    Py_ssize_t len, cap, item;
} Vec;

static int vec_push(Vec *v, const void *x) {
    if (v->len == v->cap) {
        Py_ssize_t cap = v->cap ? v->cap * 2 : 1024;
        char *d = PyMem_Realloc(v->data, (size_t)cap * (size_t)v->item);
        if (!d) return -1;
        v->data = d;
        v->cap = cap;
    }
    memcpy(v->data + v->len * v->item, x, (size_t)v->item);
    v->len++;
    return 0;
}

static void vec_free(Vec *v) { PyMem_Free(v->data); v->data = NULL; v->len = v->cap = 0; }

static PyObject *vec_bytes(Vec *v) {
    return PyBytes_FromStringAndSize(v->data ? v->data : "", v->len * v->item);
}

/* ------------------------------------------------------------------ span -> code tables */
typedef struct {
    Py_ssize_t *slots;  /* index into spans + 1; 0 = empty */
    Py_ssize_t mask;
    Vec spans;          /* Span */
    Vec hashes;         /* uint64_t */
    Py_ssize_t lookups, probes;  /* the cost so far, against PROBE_BUDGET */
} Table;

/* A random key per process (set at import) keeps a file from being written to collide: names
   that share a hash would make every lookup walk one long run of slots. Whatever the hash, a
   table whose lookups probe more than PROBE_SLACK slots each on average (plus PROBE_BASE) gives
   the document to the typed decoder, whose dicts hash with the interpreter's keyed hash: an
   input's cost stays linear in its size. At a load factor of at most 1/2 a lookup probes
   about 1.5-2.5 slots on average. */
static uint64_t hash_key = 0x9E3779B97F4A7C15ULL;
#define PROBE_SLACK 16
#define PROBE_BASE 4096
#define TABLE_COSTLY (-3)

static uint64_t hash_bytes(const char *s, Py_ssize_t n) {
    /* a word at a time: kernel names run to hundreds of bytes */
    uint64_t h = hash_key ^ (uint64_t)n, w;
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        memcpy(&w, s + i, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDULL;
        h ^= h >> 32;
    }
    w = 0;
    memcpy(&w, s + i, (size_t)(n - i));
    h = (h ^ w) * 0xC4CEB9FE1A85EC53ULL;
    return h ^ (h >> 29);
}

static int table_init(Table *t) {
    t->mask = 255;
    t->slots = PyMem_Calloc(256, sizeof(Py_ssize_t));
    t->spans = (Vec){NULL, 0, 0, sizeof(Span)};
    t->hashes = (Vec){NULL, 0, 0, sizeof(uint64_t)};
    t->lookups = t->probes = 0;
    return t->slots ? 0 : -1;
}

static void table_free(Table *t) { PyMem_Free(t->slots); t->slots = NULL; vec_free(&t->spans); vec_free(&t->hashes); }

static int table_grow(Table *t) {
    Py_ssize_t size = (t->mask + 1) * 2;
    Py_ssize_t *slots = PyMem_Calloc((size_t)size, sizeof(Py_ssize_t));
    if (!slots) return -1;
    uint64_t *hs = (uint64_t *)t->hashes.data;
    for (Py_ssize_t i = 0; i < t->spans.len; i++) {
        Py_ssize_t j = (Py_ssize_t)(hs[i] & (uint64_t)(size - 1));
        while (slots[j]) j = (j + 1) & (size - 1);
        slots[j] = i + 1;
    }
    PyMem_Free(t->slots);
    t->slots = slots;
    t->mask = size - 1;
    return 0;
}

/* The code of span s (its first-seen order), -1 on a memory error, TABLE_COSTLY when the
   table's lookups have probed beyond their budget. */
static Py_ssize_t table_code(Table *t, const char *s, Py_ssize_t n) {
    uint64_t h = hash_bytes(s, n);
    Py_ssize_t j = (Py_ssize_t)(h & (uint64_t)t->mask);
    Span *sp = (Span *)t->spans.data;
    uint64_t *hs = (uint64_t *)t->hashes.data;
    t->lookups++;
    while (t->slots[j]) {
        Py_ssize_t k = t->slots[j] - 1;
        if (hs[k] == h && sp[k].n == n && memcmp(sp[k].s, s, (size_t)n) == 0) return k;
        j = (j + 1) & t->mask;
        if (++t->probes > PROBE_SLACK * t->lookups + PROBE_BASE) return TABLE_COSTLY;
    }
    Span ns = {s, n};
    if (vec_push(&t->spans, &ns) < 0 || vec_push(&t->hashes, &h) < 0) return -1;
    t->slots[j] = t->spans.len;
    if (t->spans.len * 2 > t->mask + 1 && table_grow(t) < 0) return -1;
    return t->spans.len - 1;
}

/* ------------------------------------------------------------------ JSON lexing */
static inline void skip_ws(Cur *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\n' || *c->p == '\r' || *c->p == '\t')) c->p++;
}

static inline int hexval(char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

/* bytes that end a run of plain string characters: '"', '\\' and the control characters */
static unsigned char STR_STOP[256];

static void init_tables(void) {
    for (int i = 0; i < 0x20; i++) STR_STOP[i] = 1;
    STR_STOP['"'] = STR_STOP['\\'] = 1;
}

/* At '"': the content span (without quotes) and whether it holds an escape; 0 ok, -1 not JSON. */
static int scan_string(Cur *c, Span *out, int *escaped) {
    const char *p = c->p + 1, *end = c->end;
    int esc = 0;
    for (;;) {
        while (p < end && !STR_STOP[(unsigned char)*p]) p++;
        if (p >= end || (unsigned char)*p < 0x20) return -1;
        if (*p == '"') break;
        esc = 1;  /* a backslash */
        if (p + 1 >= end) return -1;
        switch (p[1]) {
        case '"': case '\\': case '/': case 'b': case 'f': case 'n': case 'r': case 't':
            p += 2; break;
        case 'u': {
            /* the typed decoder checks every escape, in skipped strings too: a high surrogate
               must be followed by a low one, and a low one never stands alone */
            unsigned cp = 0;
            if (p + 6 > end) return -1;
            for (int i = 2; i < 6; i++) {
                int h = hexval(p[i]);
                if (h < 0) return -1;
                cp = cp << 4 | (unsigned)h;
            }
            p += 6;
            if (cp >= 0xDC00 && cp <= 0xDFFF) return -1;
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                unsigned lo = 0;
                if (p + 6 > end || p[0] != '\\' || p[1] != 'u') return -1;
                for (int i = 2; i < 6; i++) {
                    int h = hexval(p[i]);
                    if (h < 0) return -1;
                    lo = lo << 4 | (unsigned)h;
                }
                if (lo < 0xDC00 || lo > 0xDFFF) return -1;
                p += 6;
            }
            break;
        }
        default:
            return -1;
        }
    }
    out->s = c->p + 1;
    out->n = p - out->s;
    *escaped = esc;
    c->p = p + 1;
    return 0;
}

/* At '-' or a digit: the number's span; *is_int when it has no fraction or exponent. */
static int scan_number(Cur *c, Span *out, int *is_int) {
    const char *p = c->p, *end = c->end;
    int integer = 1;
    if (p < end && *p == '-') p++;
    if (p >= end) return -1;
    if (*p == '0') p++;
    else if (*p >= '1' && *p <= '9') { while (p < end && *p >= '0' && *p <= '9') p++; }
    else return -1;
    if (p < end && *p == '.') {
        integer = 0;
        p++;
        if (p >= end || !(*p >= '0' && *p <= '9')) return -1;
        while (p < end && *p >= '0' && *p <= '9') p++;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        integer = 0;
        p++;
        if (p < end && (*p == '+' || *p == '-')) p++;
        if (p >= end || !(*p >= '0' && *p <= '9')) return -1;
        while (p < end && *p >= '0' && *p <= '9') p++;
    }
    out->s = c->p;
    out->n = p - c->p;
    *is_int = integer;
    c->p = p;
    return 0;
}

static int scan_literal(Cur *c, const char *lit, Py_ssize_t n) {
    if (c->end - c->p < n || memcmp(c->p, lit, (size_t)n) != 0) return -1;
    c->p += n;
    return 0;
}

/* Skip one value (validating it), iteratively; 0 ok, -1 not JSON or too deep. */
static int skip_value(Cur *c) {
    char stack[MAX_DEPTH];
    int depth = 0;
    Span s;
    int flag;
    for (;;) {
        skip_ws(c);
        if (c->p >= c->end) return -1;
        char ch = *c->p;
        if (ch == '{' || ch == '[') {
            if (depth >= MAX_DEPTH) return -1;
            stack[depth++] = ch;
            c->p++;
            skip_ws(c);
            if (c->p >= c->end) return -1;
            if (*c->p == (ch == '{' ? '}' : ']')) { c->p++; depth--; goto after_value; }
            if (ch == '{') {
                if (*c->p != '"' || scan_string(c, &s, &flag) < 0) return -1;
                skip_ws(c);
                if (c->p >= c->end || *c->p != ':') return -1;
                c->p++;
            }
            continue;
        } else if (ch == '"') {
            if (scan_string(c, &s, &flag) < 0) return -1;
        } else if (ch == '-' || (ch >= '0' && ch <= '9')) {
            if (scan_number(c, &s, &flag) < 0) return -1;
        } else if (ch == 't') {
            if (scan_literal(c, "true", 4) < 0) return -1;
        } else if (ch == 'f') {
            if (scan_literal(c, "false", 5) < 0) return -1;
        } else if (ch == 'n') {
            if (scan_literal(c, "null", 4) < 0) return -1;
        } else {
            return -1;
        }
    after_value:
        for (;;) {
            if (depth == 0) return 0;
            skip_ws(c);
            if (c->p >= c->end) return -1;
            char top = stack[depth - 1];
            if (*c->p == ',') {
                c->p++;
                if (top == '{') {
                    skip_ws(c);
                    if (c->p >= c->end || *c->p != '"' || scan_string(c, &s, &flag) < 0) return -1;
                    skip_ws(c);
                    if (c->p >= c->end || *c->p != ':') return -1;
                    c->p++;
                }
                break;  /* the next value */
            }
            if (*c->p == (top == '{' ? '}' : ']')) { c->p++; depth--; continue; }
            return -1;
        }
    }
}

/* A value's span: starts at its first character, ends after it. */
static int value_span(Cur *c, Span *out) {
    skip_ws(c);
    const char *start = c->p;
    if (skip_value(c) < 0) return -1;
    out->s = start;
    out->n = c->p - start;
    return 0;
}

/* An integer literal within int64; 0 ok, -1 not an integer or out of range. */
static int span_int64(Span v, int64_t *out) {
    const char *p = v.s, *end = v.s + v.n;
    int neg = 0;
    if (p < end && *p == '-') { neg = 1; p++; }
    if (p >= end) return -1;
    uint64_t acc = 0;
    for (; p < end; p++) {
        if (*p < '0' || *p > '9') return -1;
        unsigned d = (unsigned)(*p - '0');
        if (acc > (UINT64_MAX - d) / 10) return -1;
        acc = acc * 10 + d;
    }
    if (neg) {
        if (acc > (uint64_t)INT64_MAX + 1) return -1;
        *out = acc == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)acc;
    } else {
        if (acc > (uint64_t)INT64_MAX) return -1;
        *out = (int64_t)acc;
    }
    return 0;
}

static const double POW10[] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11,
                               1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* A JSON number as the nearest double (what Python's float() gives): exact integer mantissa
   below 2**53 scaled by an exact power of ten is correctly rounded by one operation; anything
   else goes through PyOS_string_to_double. 0 ok, -1 not finite or a Python error (cleared). */
static int span_double(Span v, double *out) {
    const char *p = v.s, *end = v.s + v.n;
    int neg = 0, frac = 0, digits = 0, has_point = 0;
    uint64_t m = 0;
    if (p < end && *p == '-') { neg = 1; p++; }
    for (; p < end && *p >= '0' && *p <= '9'; p++) {
        if (m || *p != '0') digits++;
        m = m * 10 + (uint64_t)(*p - '0');
        if (digits > 18) goto slow;
    }
    if (p < end && *p == '.') {
        has_point = 1;
        for (p++; p < end && *p >= '0' && *p <= '9'; p++) {
            if (m || *p != '0') digits++;
            m = m * 10 + (uint64_t)(*p - '0');
            frac++;
            if (digits > 18) goto slow;
        }
    }
    if (p != end || frac > 22 || m > (1ULL << 53)) goto slow;
    {
        double d = (double)m / POW10[frac];
        /* an integer literal is an int to the typed decoder: -0 is 0, +0.0 as a float */
        *out = (neg && !(m == 0 && !has_point)) ? -d : d;
        return 0;
    }
slow:
    {
        char buf[64];
        char *tmp = buf;
        if (v.n >= (Py_ssize_t)sizeof(buf)) {
            tmp = PyMem_Malloc((size_t)v.n + 1);
            if (!tmp) return -1;
        }
        memcpy(tmp, v.s, (size_t)v.n);
        tmp[v.n] = 0;
        char *stop = NULL;
        double d = PyOS_string_to_double(tmp, &stop, NULL);
        int ok = !(d == -1.0 && PyErr_Occurred()) && stop == tmp + v.n && isfinite(d);
        if (tmp != buf) PyMem_Free(tmp);
        if (!ok) { PyErr_Clear(); return -1; }
        *out = d;
        return 0;
    }
}

/* A string's content as a str (escapes decoded, strict UTF-8); NULL with no error set when
   it is not one the typed decoder would accept, NULL with an error on memory failure. */
static PyObject *span_str(Span s, int escaped) {
    if (!escaped) {
        PyObject *r = PyUnicode_DecodeUTF8(s.s, s.n, NULL);
        if (!r && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) PyErr_Clear();
        return r;
    }
    char *buf = PyMem_Malloc((size_t)s.n + 1);
    if (!buf) { PyErr_NoMemory(); return NULL; }
    Py_ssize_t o = 0;
    const char *p = s.s, *end = s.s + s.n;
    while (p < end) {
        if (*p != '\\') { buf[o++] = *p++; continue; }
        char e = p[1];  /* scan_string checked every escape's form */
        p += 2;
        switch (e) {
        case 'b': buf[o++] = '\b'; break;
        case 'f': buf[o++] = '\f'; break;
        case 'n': buf[o++] = '\n'; break;
        case 'r': buf[o++] = '\r'; break;
        case 't': buf[o++] = '\t'; break;
        case 'u': {
            uint32_t cp = (uint32_t)(hexval(p[0]) << 12 | hexval(p[1]) << 8 | hexval(p[2]) << 4 | hexval(p[3]));
            p += 4;
            if (cp >= 0xD800 && cp <= 0xDBFF && end - p >= 6 && p[0] == '\\' && p[1] == 'u') {
                uint32_t lo = (uint32_t)(hexval(p[2]) << 12 | hexval(p[3]) << 8 | hexval(p[4]) << 4 | hexval(p[5]));
                if (lo >= 0xDC00 && lo <= 0xDFFF) { cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00); p += 6; }
            }
            if (cp >= 0xD800 && cp <= 0xDFFF) { PyMem_Free(buf); return NULL; }  /* lone surrogate */
            if (cp < 0x80) buf[o++] = (char)cp;
            else if (cp < 0x800) { buf[o++] = (char)(0xC0 | cp >> 6); buf[o++] = (char)(0x80 | (cp & 0x3F)); }
            else if (cp < 0x10000) {
                buf[o++] = (char)(0xE0 | cp >> 12); buf[o++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                buf[o++] = (char)(0x80 | (cp & 0x3F));
            } else {
                buf[o++] = (char)(0xF0 | cp >> 18); buf[o++] = (char)(0x80 | ((cp >> 12) & 0x3F));
                buf[o++] = (char)(0x80 | ((cp >> 6) & 0x3F)); buf[o++] = (char)(0x80 | (cp & 0x3F));
            }
            break;
        }
        default: buf[o++] = e; break;  /* " \ / */
        }
    }
    PyObject *r = PyUnicode_DecodeUTF8(buf, o, NULL);
    PyMem_Free(buf);
    if (!r && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) PyErr_Clear();
    return r;
}

/* ------------------------------------------------------------------ keys */
typedef struct {
    const char *s;
    Py_ssize_t n;
} Key;

#define K(lit) {lit, (Py_ssize_t)sizeof(lit) - 1}

static int key_is(Span k, const char *lit) {
    size_t n = strlen(lit);
    return (size_t)k.n == n && memcmp(k.s, lit, n) == 0;
}

static inline int key_index(Span k, const Key *keys, int nkeys) {
    for (int i = 0; i < nkeys; i++)
        if (keys[i].n == k.n && keys[i].s[0] == k.s[0] && memcmp(keys[i].s, k.s, (size_t)k.n) == 0) return i;
    return -1;
}

enum { F_PH, F_CAT, F_NAME, F_PID, F_TID, F_TS, F_DUR, F_ARGS, N_EV };
static const Key EV_KEYS[N_EV] = {K("ph"), K("cat"), K("name"), K("pid"), K("tid"), K("ts"), K("dur"), K("args")};

/* args of complete events: the int fields, the span fields, the collective keys (the order of
   _columns.COMM_KEYS) */
#define N_LAUNCH 7
enum { A_EXT, A_STREAM, A_CORR, A_DIMS, A_TYPES, A_CONC, A_COMM0, A_EXT_LC = A_COMM0 + 12,
       A_DIMS_LC, A_LAUNCH0, N_ARGS = A_LAUNCH0 + N_LAUNCH };
static const Key ARG_KEYS[N_ARGS] = {
    K("External id"), K("stream"), K("correlation"), K("Input Dims"), K("Input type"),
    K("Concrete Inputs"), K("Collective name"), K("In msg nelems"), K("Out msg nelems"),
    K("Group size"), K("dtype"), K("Process Group Name"), K("Process Group Description"),
    K("Process Group Ranks"), K("Seq"), K("Rank"), K("Src Rank"), K("Dst Rank"),
    K("external id"), K("Input dims"), /* PyTorch 1.8-1.10; then the launch figures, in
                                            _columns.LAUNCH_KEYS' order */
    K("grid"), K("block"), K("registers per thread"), K("shared memory"), K("blocks per SM"),
    K("warps per SM"), K("est. achieved occupancy %")};
#define A_COLL A_COMM0
#define A_PG (A_COMM0 + 5)

enum { M_DEVTYPE, M_DEVID, M_ADDR, M_BYTES, M_TOTAL_ALLOC, M_TOTAL_RES, N_MEM };
static const Key MEM_KEYS[N_MEM] = {K("Device Type"), K("Device Id"), K("Addr"), K("Bytes"),
                                   K("Total Allocated"), K("Total Reserved")};
static const int64_t MEM_DEFAULT[N_MEM] = {-1, -1, 0, 0, -1, -1};

/* A member's key and its colon: "key" : (an escaped key is refused). 0 ok, -1 refused. */
static int read_key(Cur *c, Span *k) {
    int esc;
    skip_ws(c);
    if (c->p >= c->end || *c->p != '"' || scan_string(c, k, &esc) < 0 || esc) return -1;
    skip_ws(c);
    if (c->p >= c->end || *c->p != ':') return -1;
    c->p++;
    return 0;
}

/* Read an object's members into spans of the known keys (others skipped); repeated known keys
   and escaped keys are refused. At '{'. 0 ok, -1 refused. When ``inner`` is given, the value of
   key ``inner_at``, where it is an object, is read at once into the spans of ``inner`` (the args
   of a complete event, read in the same pass): *inner_read says whether it was. */
static int read_object(Cur *c, const Key *keys, int nkeys, Span *vals, int *seen, int inner_at,
                       const Key *inner, int ninner, Span *ivals, int *iseen, int *inner_read) {
    Span k;
    for (int i = 0; i < nkeys; i++) seen[i] = 0;
    c->p++;
    skip_ws(c);
    if (c->p < c->end && *c->p == '}') { c->p++; return 0; }
    for (;;) {
        if (read_key(c, &k) < 0) return -1;
        int idx = k.n ? key_index(k, keys, nkeys) : -1;
        if (idx >= 0 && idx == inner_at && inner) {
            skip_ws(c);
            if (seen[idx]) return -1;
            if (c->p < c->end && *c->p == '{') {
                const char *start = c->p;
                if (read_object(c, inner, ninner, ivals, iseen, -1, NULL, 0, NULL, NULL, NULL) < 0) return -1;
                vals[idx].s = start;
                vals[idx].n = c->p - start;
                *inner_read = 1;
            } else if (value_span(c, &vals[idx]) < 0) {
                return -1;
            }
            seen[idx] = 1;
        } else if (idx >= 0) {
            if (seen[idx] || value_span(c, &vals[idx]) < 0) return -1;
            seen[idx] = 1;
        } else if (skip_value(c) < 0) {
            return -1;
        }
        skip_ws(c);
        if (c->p >= c->end) return -1;
        if (*c->p == ',') { c->p++; continue; }
        if (*c->p == '}') { c->p++; return 0; }
        return -1;
    }
}

static int is_null(Span v) { return v.n == 4 && memcmp(v.s, "null", 4) == 0; }

static const char PHASES[] = "XiBEIbnesStfPONDMRCc()";

/* ------------------------------------------------------------------ the scan */
typedef struct {
    Vec name, cat, pid, tid, pid_s, tid_s, ts, dur, stream, corr, ext, dims, types, conc;
    Table t_name, t_cat, t_pid_s, t_tid_s, t_dims, t_types, t_conc;
    Vec launch[N_LAUNCH];
    Table t_launch[N_LAUNCH];
    PyObject *comm, *mem, *top, *check;  /* check: spans the caller decodes only to validate */
    Py_ssize_t n_events;
} Out;

/* a string column: the code of its content (escapes decoded later, per distinct value) */
static int string_code(Table *t, Span v, int64_t *code) {
    if (v.n < 2 || v.s[0] != '"') return -1;
    Py_ssize_t k = table_code(t, v.s, v.n);  /* the quoted span: escapes are told apart */
    if (k == TABLE_COSTLY) return -1;
    if (k < 0) return -2;
    *code = k;
    return 0;
}

/* pid / tid: int64 value, or the code of a string (-1 when not a string) */
static int id_value(Table *t, Span v, int present, int64_t *val, int32_t *scode) {
    *val = -1;
    *scode = -1;
    if (!present || is_null(v)) return 0;
    if (v.s[0] == '"') {
        Py_ssize_t k = table_code(t, v.s, v.n);
        if (k == TABLE_COSTLY) return -1;
        if (k < 0) return -2;
        if (k > INT32_MAX) return -1;
        *scode = (int32_t)k;
        return 0;
    }
    return span_int64(v, val);  /* a float, bool, object or array: not the typed decoder's */
}

static int number_value(Span v, int present, double *out) {
    *out = 0.0;
    if (!present) return 0;
    if (!(v.s[0] == '-' || (v.s[0] >= '0' && v.s[0] <= '9'))) return -1;
    return span_double(v, out);
}

static int int_arg(Span v, int present, int64_t *out) {
    *out = -1;
    if (!present) return 0;
    return span_int64(v, out);
}

static int span_code(Table *t, Vec *col, Span v, int present) {
    int32_t code = -1;
    if (present) {
        Py_ssize_t k = table_code(t, v.s, v.n);
        if (k == TABLE_COSTLY) return -1;
        if (k < 0) return -2;
        if (k > INT32_MAX) return -1;
        code = (int32_t)k;
    }
    return vec_push(col, &code) < 0 ? -2 : 0;
}

static PyObject *span_tuple(Cur *c, Span v) {
    return Py_BuildValue("(nn)", (Py_ssize_t)(v.s - c->base), (Py_ssize_t)(v.s - c->base + v.n));
}

/* A value the typed decoder decodes (an Any field) but the columns do not keep: its span goes to
   the caller, which decodes it once to refuse the document where the typed decoder would. */
static int push_check(Cur *c, Out *o, Span v) {
    PyObject *x = span_tuple(c, v);
    if (!x) return -2;
    int fail = PyList_Append(o->check, x);
    Py_DECREF(x);
    return fail ? -2 : 0;
}

/* -1 refused (not the typed decoder's), -2 memory error */
static int complete_event(Cur *c, Out *o, Span *ev, int *seen, Span *a, int *aseen, int args_read) {
    int64_t code, v64;
    int32_t s32;
    double d;
    int r;
    if (seen[F_NAME]) { if ((r = string_code(&o->t_name, ev[F_NAME], &code)) < 0) return r; }
    else { Span empty = {"\"\"", 2}; if ((r = string_code(&o->t_name, empty, &code)) < 0) return r; }
    if (vec_push(&o->name, &code) < 0) return -2;
    if (seen[F_CAT]) { if ((r = string_code(&o->t_cat, ev[F_CAT], &code)) < 0) return r; }
    else { Span empty = {"\"\"", 2}; if ((r = string_code(&o->t_cat, empty, &code)) < 0) return r; }
    if (vec_push(&o->cat, &code) < 0) return -2;
    if ((r = id_value(&o->t_pid_s, ev[F_PID], seen[F_PID], &v64, &s32)) < 0) return r;
    if (vec_push(&o->pid, &v64) < 0 || vec_push(&o->pid_s, &s32) < 0) return -2;
    if ((r = id_value(&o->t_tid_s, ev[F_TID], seen[F_TID], &v64, &s32)) < 0) return r;
    if (vec_push(&o->tid, &v64) < 0 || vec_push(&o->tid_s, &s32) < 0) return -2;
    if (number_value(ev[F_TS], seen[F_TS], &d) < 0) return -1;
    if (vec_push(&o->ts, &d) < 0) return -2;
    if (number_value(ev[F_DUR], seen[F_DUR], &d) < 0) return -1;
    if (vec_push(&o->dur, &d) < 0) return -2;

    if (!args_read) {
        memset(aseen, 0, sizeof(int) * N_ARGS);
        if (seen[F_ARGS] && !is_null(ev[F_ARGS])) return -1;  /* args neither an object nor null */
    }
    if (int_arg(a[A_STREAM], aseen[A_STREAM], &v64) < 0) return -1;
    if (vec_push(&o->stream, &v64) < 0) return -2;
    if (int_arg(a[A_CORR], aseen[A_CORR], &v64) < 0) return -1;
    if (vec_push(&o->corr, &v64) < 0) return -2;
    if (int_arg(a[A_EXT], aseen[A_EXT], &v64) < 0) return -1;
    {
        int64_t lc;  /* "external id" (PyTorch 1.8-1.10): read, and used where External id is not >= 0 */
        if (int_arg(a[A_EXT_LC], aseen[A_EXT_LC], &lc) < 0) return -1;
        if (v64 < 0) v64 = lc;
    }
    if (vec_push(&o->ext, &v64) < 0) return -2;
    {   /* "Input dims" (PyTorch 1.8-1.10) where "Input Dims" is absent or null */
        int old = (!aseen[A_DIMS] || is_null(a[A_DIMS])) && aseen[A_DIMS_LC];
        if (old && aseen[A_DIMS] && push_check(c, o, a[A_DIMS]) < 0) return -2;
        if ((r = span_code(&o->t_dims, &o->dims, old ? a[A_DIMS_LC] : a[A_DIMS],
                           old || aseen[A_DIMS])) < 0) return r;
        if (!old && aseen[A_DIMS_LC] && push_check(c, o, a[A_DIMS_LC]) < 0) return -2;
    }
    if ((r = span_code(&o->t_types, &o->types, a[A_TYPES], aseen[A_TYPES])) < 0) return r;
    if ((r = span_code(&o->t_conc, &o->conc, a[A_CONC], aseen[A_CONC])) < 0) return r;
    for (int k = 0; k < N_LAUNCH; k++)
        if ((r = span_code(&o->t_launch[k], &o->launch[k], a[A_LAUNCH0 + k], aseen[A_LAUNCH0 + k])) < 0)
            return r;
    if ((aseen[A_COLL] && !is_null(a[A_COLL])) || (aseen[A_PG] && !is_null(a[A_PG]))) {
        PyObject *spans = PyTuple_New(12);
        if (!spans) return -2;
        for (int i = 0; i < 12; i++) {
            PyObject *x;
            if (aseen[A_COMM0 + i]) { x = span_tuple(c, a[A_COMM0 + i]); if (!x) { Py_DECREF(spans); return -2; } }
            else { x = Py_None; Py_INCREF(x); }
            PyTuple_SET_ITEM(spans, i, x);
        }
        PyObject *row = Py_BuildValue("(nN)", o->name.len - 1, spans);
        if (!row) return -2;
        int fail = PyList_Append(o->comm, row);
        Py_DECREF(row);
        if (fail) return -2;
    } else {
        for (int i = 0; i < 12; i++)
            if (aseen[A_COMM0 + i] && push_check(c, o, a[A_COMM0 + i]) < 0) return -2;
    }
    return 0;
}

static int has_high_byte(Span v) {
    for (Py_ssize_t i = 0; i < v.n; i++)
        if ((unsigned char)v.s[i] >= 0x80) return 1;
    return 0;
}

/* An instant event: the typed decoder reads its name (a str), ts (a number) and, in args,
   the six memory fields (any JSON); only '[memory]' events with args are kept. */
static int instant_event(Cur *c, Out *o, Span *ev, int *seen) {
    double ts;
    int is_memory = 0;
    if (seen[F_NAME]) {
        Span v = ev[F_NAME];
        if (v.s[0] != '"') return -1;
        Cur sc = {c->base, v.s, v.s + v.n};
        Span content;
        int esc;
        if (scan_string(&sc, &content, &esc) < 0) return -1;
        if (esc || has_high_byte(content)) {  /* decoded: compared, and refused as the decoder would */
            PyObject *s = span_str(content, esc);
            if (!s) return PyErr_Occurred() ? -2 : -1;
            is_memory = PyUnicode_CompareWithASCIIString(s, "[memory]") == 0;
            Py_DECREF(s);
        } else {
            is_memory = key_is(content, "[memory]");
        }
    }
    if (number_value(ev[F_TS], seen[F_TS], &ts) < 0) return -1;
    if (!seen[F_ARGS] || is_null(ev[F_ARGS])) return 0;
    if (ev[F_ARGS].s[0] != '{') return -1;
    Span m[N_MEM];
    int mseen[N_MEM];
    Cur ac = {c->base, ev[F_ARGS].s, ev[F_ARGS].s + ev[F_ARGS].n};
    if (read_object(&ac, MEM_KEYS, N_MEM, m, mseen, -1, NULL, 0, NULL, NULL, NULL) < 0) return -1;
    int64_t v[N_MEM];
    for (int i = 0; i < N_MEM; i++) {
        v[i] = MEM_DEFAULT[i];
        if (!mseen[i]) continue;
        if (is_memory) {
            if (span_int64(m[i], &v[i]) < 0) return -1;  /* only plain integers here */
        } else if (push_check(c, o, m[i]) < 0) {
            return -2;
        }
    }
    if (!is_memory) return 0;
    /* (ts, Bytes, Total Allocated, Total Reserved, Device Type, Device Id, Addr) */
    PyObject *row = Py_BuildValue("(dLLLLLL)", ts, (long long)v[M_BYTES], (long long)v[M_TOTAL_ALLOC],
                                  (long long)v[M_TOTAL_RES], (long long)v[M_DEVTYPE],
                                  (long long)v[M_DEVID], (long long)v[M_ADDR]);
    if (!row) return -2;
    int fail = PyList_Append(o->mem, row);
    Py_DECREF(row);
    return fail ? -2 : 0;
}

static int one_event(Cur *c, Out *o) {
    Span ev[N_EV];
    int seen[N_EV];
    skip_ws(c);
    if (c->p >= c->end || *c->p != '{') return -1;
    Span a[N_ARGS];
    int aseen[N_ARGS], args_read = 0;
    if (read_object(c, EV_KEYS, N_EV, ev, seen, F_ARGS, ARG_KEYS, N_ARGS, a, aseen, &args_read) < 0
        || !seen[F_PH])
        return -1;
    Span ph = ev[F_PH];
    if (ph.n != 3 || ph.s[0] != '"' || ph.s[2] != '"' || !memchr(PHASES, ph.s[1], sizeof(PHASES) - 1))
        return -1;  /* an unknown (or escaped) phase: the typed decoder refuses the document */
    if (ph.s[1] == 'X') return complete_event(c, o, ev, seen, a, aseen, args_read);
    if (ph.s[1] == 'i') return instant_event(c, o, ev, seen);
    return 0;
}

static int scan_events(Cur *c, Out *o) {
    c->p++;  /* '[' */
    skip_ws(c);
    if (c->p < c->end && *c->p == ']') { c->p++; return 0; }
    for (;;) {
        int r = one_event(c, o);
        if (r < 0) return r;
        o->n_events++;
        skip_ws(c);
        if (c->p >= c->end) return -1;
        if (*c->p == ',') { c->p++; continue; }
        if (*c->p == ']') { c->p++; return 0; }
        return -1;
    }
}

static int scan_doc(Cur *c, Out *o) {
    Span k;
    int have_events = 0;
    skip_ws(c);
    if (c->p >= c->end || *c->p != '{') return -1;
    c->p++;
    skip_ws(c);
    if (c->p < c->end && *c->p == '}') return -1;  /* no traceEvents */
    for (;;) {
        if (read_key(c, &k) < 0) return -1;
        skip_ws(c);
        if (key_is(k, "traceEvents")) {
            if (have_events || c->p >= c->end || *c->p != '[') return -1;
            have_events = 1;
            int r = scan_events(c, o);
            if (r < 0) return r;
        } else {
            Span v;
            if (value_span(c, &v) < 0) return -1;
            PyObject *key = PyUnicode_DecodeUTF8(k.s, k.n, NULL);
            if (!key) { if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) { PyErr_Clear(); return -1; } return -2; }
            PyObject *item = Py_BuildValue("(Nnn)", key, (Py_ssize_t)(v.s - c->base),
                                           (Py_ssize_t)(v.s - c->base + v.n));
            if (!item) return -2;
            int fail = PyList_Append(o->top, item);
            Py_DECREF(item);
            if (fail) return -2;
        }
        skip_ws(c);
        if (c->p >= c->end) return -1;
        if (*c->p == ',') { c->p++; continue; }
        if (*c->p == '}') { c->p++; break; }
        return -1;
    }
    skip_ws(c);
    return (c->p == c->end && have_events) ? 0 : -1;
}

/* the distinct values of a string column, decoded */
static PyObject *table_strings(Table *t) {
    Span *sp = (Span *)t->spans.data;
    PyObject *out = PyList_New(t->spans.len);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < t->spans.len; i++) {
        Cur sc = {sp[i].s, sp[i].s, sp[i].s + sp[i].n};
        Span content;
        int esc;
        PyObject *s = NULL;
        if (scan_string(&sc, &content, &esc) == 0) s = span_str(content, esc);
        if (!s) {
            Py_DECREF(out);
            if (!PyErr_Occurred()) { Py_RETURN_NONE; }  /* invalid UTF-8 / lone surrogate */
            return NULL;
        }
        PyList_SET_ITEM(out, i, s);
    }
    return out;
}

/* the distinct raw spans of a column, as (start, end) offsets */
static PyObject *table_spans(Table *t, const char *base) {
    Span *sp = (Span *)t->spans.data;
    PyObject *out = PyList_New(t->spans.len);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < t->spans.len; i++) {
        PyObject *x = Py_BuildValue("(nn)", (Py_ssize_t)(sp[i].s - base), (Py_ssize_t)(sp[i].s - base + sp[i].n));
        if (!x) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, i, x);
    }
    return out;
}

static void out_free(Out *o) {
    Vec *vs[] = {&o->name, &o->cat, &o->pid, &o->tid, &o->pid_s, &o->tid_s, &o->ts, &o->dur,
                 &o->stream, &o->corr, &o->ext, &o->dims, &o->types, &o->conc};
    for (size_t i = 0; i < sizeof(vs) / sizeof(vs[0]); i++) vec_free(vs[i]);
    Table *ts[] = {&o->t_name, &o->t_cat, &o->t_pid_s, &o->t_tid_s, &o->t_dims, &o->t_types, &o->t_conc};
    for (size_t i = 0; i < sizeof(ts) / sizeof(ts[0]); i++) table_free(ts[i]);
    for (int k = 0; k < N_LAUNCH; k++) { vec_free(&o->launch[k]); table_free(&o->t_launch[k]); }
    Py_XDECREF(o->comm);
    Py_XDECREF(o->mem);
    Py_XDECREF(o->top);
    Py_XDECREF(o->check);
}

/* The scan's columns as a dict; None where a string the typed decoder refuses was found while
   decoding the distinct values; NULL with an error set on a memory error (building stops at the
   first failure: nothing runs with an error set). */
static PyObject *build_result(Out *o, const char *base) {
    enum { N_ITEMS = 28 };
    static const char *keys[N_ITEMS] = {
        "names", "cats", "pid_strs", "tid_strs", "name", "cat", "pid", "pid_s", "tid", "tid_s",
        "ts", "dur", "stream", "corr", "ext", "dims", "dims_spans", "types", "types_spans",
        "concrete", "concrete_spans", "comm", "mem", "top", "check", "n_events", "n", "launch"};
    PyObject *vals[N_ITEMS] = {NULL};
    PyObject *result = NULL;
    Table *strings[4] = {&o->t_name, &o->t_cat, &o->t_pid_s, &o->t_tid_s};
    Vec *vecs[11] = {&o->name, &o->cat, &o->pid, &o->pid_s, &o->tid, &o->tid_s, &o->ts, &o->dur,
                     &o->stream, &o->corr, &o->ext};
    int i = 0;
    for (int k = 0; k < 4; k++, i++) {
        vals[i] = table_strings(strings[k]);
        if (vals[i] == Py_None) { result = Py_None; Py_INCREF(result); goto out; }
        if (!vals[i]) goto out;
    }
    for (int k = 0; k < 11; k++, i++)
        if (!(vals[i] = vec_bytes(vecs[k]))) goto out;
    Vec *span_vecs[3] = {&o->dims, &o->types, &o->conc};
    Table *span_tables[3] = {&o->t_dims, &o->t_types, &o->t_conc};
    for (int k = 0; k < 3; k++) {
        if (!(vals[i++] = vec_bytes(span_vecs[k]))) goto out;
        if (!(vals[i++] = table_spans(span_tables[k], base))) goto out;
    }
    PyObject *lists[4] = {o->comm, o->mem, o->top, o->check};
    for (int k = 0; k < 4; k++, i++) { vals[i] = lists[k]; Py_INCREF(vals[i]); }
    if (!(vals[i++] = PyLong_FromSsize_t(o->n_events))) goto out;
    if (!(vals[i++] = PyLong_FromSsize_t(o->ts.len))) goto out;
    /* launch: a list of (codes, spans) per launch key */
    if (!(vals[i] = PyList_New(N_LAUNCH))) goto out;
    for (int k = 0; k < N_LAUNCH; k++) {
        PyObject *codes = vec_bytes(&o->launch[k]);
        PyObject *spans = codes ? table_spans(&o->t_launch[k], base) : NULL;
        PyObject *pair = spans ? PyTuple_Pack(2, codes, spans) : NULL;
        Py_XDECREF(codes);
        Py_XDECREF(spans);
        if (!pair) goto out;
        PyList_SET_ITEM(vals[i], k, pair);
    }
    i++;
    result = PyDict_New();
    if (!result) goto out;
    for (int k = 0; k < N_ITEMS; k++) {
        if (PyDict_SetItemString(result, keys[k], vals[k]) < 0) { Py_CLEAR(result); goto out; }
    }
out:
    for (int k = 0; k < N_ITEMS; k++) Py_XDECREF(vals[k]);
    return result;
}

static PyObject *scan(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    Out o;
    memset(&o, 0, sizeof(o));
    o.name.item = o.cat.item = o.pid.item = o.tid.item = o.ext.item = o.stream.item = o.corr.item = 8;
    o.ts.item = o.dur.item = 8;
    o.pid_s.item = o.tid_s.item = o.dims.item = o.types.item = o.conc.item = 4;
    for (int k = 0; k < N_LAUNCH; k++) o.launch[k].item = 4;
    PyObject *result = NULL;
    Table *ts[] = {&o.t_name, &o.t_cat, &o.t_pid_s, &o.t_tid_s, &o.t_dims, &o.t_types, &o.t_conc};
    for (size_t i = 0; i < sizeof(ts) / sizeof(ts[0]); i++)
        if (table_init(ts[i]) < 0) { PyErr_NoMemory(); goto done; }
    for (int k = 0; k < N_LAUNCH; k++)
        if (table_init(&o.t_launch[k]) < 0) { PyErr_NoMemory(); goto done; }
    o.comm = PyList_New(0);
    o.mem = PyList_New(0);
    o.top = PyList_New(0);
    o.check = PyList_New(0);
    if (!o.comm || !o.mem || !o.top || !o.check) goto done;
    Cur c = {(const char *)view.buf, (const char *)view.buf, (const char *)view.buf + view.len};
    int r = scan_doc(&c, &o);
    if (r == -2 || PyErr_Occurred()) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    if (r < 0) { result = Py_None; Py_INCREF(result); goto done; }
    result = build_result(&o, c.base);
done:
    out_free(&o);
    PyBuffer_Release(&view);
    return result;
}

/* tests: set the hash key (to build names that collide under it), and hash a span with it */
static PyObject *set_hash_key(PyObject *self, PyObject *arg) {
    unsigned long long k = PyLong_AsUnsignedLongLongMask(arg);
    if (k == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    hash_key = (uint64_t)k;
    Py_RETURN_NONE;
}

static PyObject *hash_span(PyObject *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    uint64_t h = hash_bytes((const char *)b.buf, b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_O, "scan(buffer) -> dict of columns, or None where the typed decoder must decide."},
    {"_set_hash_key", set_hash_key, METH_O, "tests: the key of the span hash (random per process)."},
    {"_hash_span", hash_span, METH_O, "tests: the hash of a span under the current key."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kineto", NULL, -1, methods, NULL, NULL, NULL, NULL};

/* the hash key: random bytes from os.urandom */
static int init_hash_key(void) {
    PyObject *os = PyImport_ImportModule("os");
    if (!os) return -1;
    PyObject *b = PyObject_CallMethod(os, "urandom", "i", 8);
    Py_DECREF(os);
    if (!b) return -1;
    if (PyBytes_Check(b) && PyBytes_GET_SIZE(b) == 8) memcpy(&hash_key, PyBytes_AS_STRING(b), 8);
    Py_DECREF(b);
    return 0;
}

PyMODINIT_FUNC PyInit__kineto(void) {
    init_tables();
    if (init_hash_key() < 0) return NULL;
    return PyModule_Create(&module);
}
