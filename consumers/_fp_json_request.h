/* _fp_json_request.h: the service's hot route in C, bytes in (the answer, bytes out, is
 * _fp_score_answer.h). Both readers take the ints of a token array with one parser,
 * json_uint_array.
 *
 * json_request(body) -> (model, lora_name, tokens) | None
 *     A /v1/score or /v1/pick body of the common shape, read in one pass: a JSON object whose
 *     keys are only "model", "lora_name" (each a string without escapes, or null) and
 *     "token_ids" (a non-empty array of JSON ints in [0, 2**32)), each at most once, nothing
 *     but whitespace after it. tokens: a memoryview of format 'I' over a bytes object (no
 *     copy; len, iteration, tolist() and the buffer protocol as an array('I') has them).
 *     None for ANY other body (other keys, escapes, floats, leading zeros, duplicates,
 *     invalid UTF-8, bad JSON...): the caller then
 *     decodes it with msgspec, which accepts or names the error; whatever this reader accepts,
 *     msgspec's ScoreRequest + token_ids_of read the same values from.
 *
 * json_tokens(raw) -> array('I') | None
 *     The token ids of a JSON array of non-negative ints below 2**32 (the text msgspec.Raw
 *     keeps of a request's "token_ids", already checked to be JSON by msgspec), without one
 *     Python int per token. None for anything else (floats, negatives, too big, not an
 *     array): the caller decodes those with msgspec, which names what is wrong and where.
 */

static inline const char *
skip_ws(const char *p, const char *end)
{
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r'))
        p++;
    return p;
}

/* the end of [p, end) without its trailing JSON whitespace */
static inline const char *
trim_ws(const char *p, const char *end)
{
    while (end > p && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\n' || end[-1] == '\r'))
        end--;
    return end;
}

/* ------------------------------------------------------------------ the token array */

/* the value of the k (1..8) decimal digits that start the 8 bytes x (first byte lowest), SWAR:
 * the digits moved to the top (the low bytes become leading zeros), then pairs, quads, eights */
static inline uint64_t
swar_digits(uint64_t x, int k)
{
    uint64_t v = (x - 0x3030303030303030ULL) << (8 * (8 - k));
    v = v * 10 + (v >> 8);
    return (((v & 0x000000FF000000FFULL) * (100 + (1000000ULL << 32))) +
            (((v >> 16) & 0x000000FF000000FFULL) * (1 + (10000ULL << 32)))) >> 32;
}

/* a byte's top bit set: not an ASCII digit (below '0', or above '9' once 0x46 is added) */
#define NONDIGIT8(x) ((((x) - 0x3030303030303030ULL) | ((x) + 0x4646464646464646ULL)) & 0x8080808080808080ULL)

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define JW_SIMD 1
#define JW_WINDOW 64 /* bytes classified at once; numbers are read up to 16 bytes past the last start */

/* per digit count d (0..8): the pshufb control that moves a number's d digits, at offset 0 of
 * a register, to the top of an 8-byte lane (bytes 8 - d .. 7), the lane's other bytes zeroed
 * (0x80: bit 7 set, which stays set with an offset of up to 15 added) */
static const uint64_t jw_ctl[9] = {
    0x8080808080808080ULL, 0x0080808080808080ULL, 0x0100808080808080ULL, 0x0201008080808080ULL,
    0x0302010080808080ULL, 0x0403020100808080ULL, 0x0504030201008080ULL, 0x0605040302010080ULL,
    0x0706050403020100ULL};
static int jw_ssse3 = -1; /* the CPU has SSSE3 (pshufb, pmaddubsw): checked on first use */

/* Up to 8 ints ahead of p in one 64-byte window of the common shape: numbers of 1 to 8
 * digits, each followed by "," or ", " (the shape json.dumps and most clients write). p: the
 * first digit of a number; p + 80 readable. The window's digits, commas, blanks and zeros are
 * four bitmasks (16 bytes at a time) and its shape is checked on them at once: every non-digit
 * byte before the window's last number start is a comma right after a digit, or one blank
 * between such a comma and a digit. Then two numbers at a time are moved into the two 8-byte
 * lanes of a register (pshufb) and both converted at once (multiply-adds of 10, 100, 10000).
 * Returns the start of the window's last number (the next window's p) with *cnt ints
 * written, or NULL: another shape, a leading zero or a long number, which the byte loop
 * decides. */
__attribute__((target("ssse3"))) static const char *
window_ints(const char *p, uint32_t *out, size_t *cnt)
{
    uint64_t D = 0, C = 0, S = 0, Z = 0;
    const __m128i zero = _mm_set1_epi8('0'), nine = _mm_set1_epi8(9), comma = _mm_set1_epi8(','),
                  blank = _mm_set1_epi8(' ');
    for (int i = 0; i < 4; i++) {
        __m128i v = _mm_loadu_si128((const __m128i *)(p + 16 * i));
        __m128i t = _mm_sub_epi8(v, zero);
        D |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_min_epu8(t, nine), t)) << (16 * i);
        C |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(v, comma)) << (16 * i);
        S |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(v, blank)) << (16 * i);
        Z |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(v, zero)) << (16 * i);
    }
    uint64_t starts = D & ~(D << 1), ends = D & ~(D >> 1); /* first and last digit of each run */
    if (!(starts & 1) || starts == 1)
        return NULL; /* not at a number, or one number filling the window */
    /* the last run may go on past the window: it is the next window's first number */
    int last = 63 - __builtin_clzll(starts);
    uint64_t below = ((uint64_t)1 << last) - 1;
    uint64_t cok = C & (ends << 1);                /* a comma right after a number */
    uint64_t sok = S & (cok << 1) & (starts >> 1); /* one blank between that comma and a number */
    if ((~D & below) != ((cok | sok) & below) || (starts & Z & (D >> 1) & below))
        return NULL; /* another shape, or a leading zero (not JSON: the byte loop refuses it) */
    starts &= below;
    const __m128i dec = _mm_set_epi8(1, 10, 1, 10, 1, 10, 1, 10, 1, 10, 1, 10, 1, 10, 1, 10);
    const __m128i hun = _mm_set_epi16(1, 100, 1, 100, 1, 100, 1, 100);
    const __m128i tth = _mm_set_epi16(1, 10000, 1, 10000, 1, 10000, 1, 10000);
    size_t n = 0;
    while (starts) {
        int s0 = __builtin_ctzll(starts), d0 = __builtin_ctzll(ends) - s0 + 1;
        starts &= starts - 1;
        ends &= ends - 1;
        if (d0 > 8)
            return NULL;
        if (starts) {
            int s1 = __builtin_ctzll(starts), e1 = __builtin_ctzll(ends), d1 = e1 - s1 + 1;
            if (d1 <= 8 && e1 - s0 < 16) { /* both in the 16 bytes at s0 */
                __m128i v = _mm_sub_epi8(_mm_loadu_si128((const __m128i *)(p + s0)), zero);
                __m128i ctl = _mm_set_epi64x((long long)(jw_ctl[d1] + (uint64_t)(s1 - s0) * 0x0101010101010101ULL),
                                             (long long)jw_ctl[d0]);
                __m128i dg = _mm_shuffle_epi8(v, ctl);       /* each number's digits, top-aligned */
                __m128i t = _mm_maddubs_epi16(dg, dec);      /* 2-digit groups */
                t = _mm_madd_epi16(t, hun);                  /* 4-digit groups */
                t = _mm_packs_epi32(t, t);                   /* (<= 9,999: fit 16 bits) */
                t = _mm_madd_epi16(t, tth);                  /* the two numbers */
                _mm_storel_epi64((__m128i *)(out + n), t);
                n += 2;
                starts &= starts - 1;
                ends &= ends - 1;
                continue;
            }
        }
        uint64_t x;
        memcpy(&x, p + s0, 8);
        out[n++] = (uint32_t)swar_digits(x, d0);
    }
    *cnt = n;
    return p + last;
}
#endif

/* The ints of a JSON array of ints in [0, 2**32) into out (room for (stop - p) / 2 + 1),
 * their count in *n. p: just after the '['; stop: the text's last byte, which is not a digit,
 * a comma or a blank (the ']' or '}' that closes the text): every scan ends at it, so none
 * reads a bound. The byte after the ']', or NULL for anything else (a float, a sign, a
 * leading zero, more than 10 digits or 2**32 and over, a missing or extra comma...).
 *
 * The common shape is read a 64-byte window at a time where the CPU has SSSE3 (window_ints:
 * the numbers' places come from bitmasks, not from the number before, so no chain of loads
 * runs through the text), else 8 bytes per number: 1 to 7 digits and a ',' with at most one
 * ' ' after it (one load, the digit count from the first non-digit, the value SWAR, the comma
 * and the blank found in the same 8 bytes). Anything else (a blank before a comma, a newline,
 * the ']', a long or malformed number, a 0) takes the byte loop for that one number and its
 * separator; a window that is not of the common shape hands over 8 numbers to the 8-byte loop. */
static const char *
json_uint_array(const char *p, const char *stop, uint32_t *out, size_t *n)
{
    size_t k = 0;
    p = skip_ws(p, stop);
    if (*p == ']') {
        *n = 0;
        return p + 1;
    }
#ifdef JW_SIMD
    if (jw_ssse3 < 0) {
        __builtin_cpu_init();
        jw_ssse3 = __builtin_cpu_supports("ssse3") ? 1 : 0;
    }
#endif
    for (;;) {
#ifdef JW_SIMD
        if (jw_ssse3) {
            for (const char *lim = stop - (JW_WINDOW + 16); p <= lim;) {
                size_t cnt;
                const char *q = window_ints(p, out + k, &cnt);
                if (q == NULL)
                    break;
                k += cnt;
                p = q;
            }
        }
#endif
        int run = 0;
        (void)run;
        for (const char *lim = stop - 8; p <= lim;) { /* p..p+8 readable: a number, its comma, one more */
            uint64_t x;
            memcpy(&x, p, 8);
            /* a first byte '1'..'9': a number without a leading zero (a '0' takes the byte loop) */
            if ((uint64_t)((x & 0xFF) - '1') > 8)
                break;
            uint64_t m = NONDIGIT8(x);
            if (m == 0)
                break; /* 8 digits or more */
            int d = __builtin_ctzll(m) >> 3;
            if (((x >> (8 * d)) & 0xFF) != ',')
                break;
            out[k++] = (uint32_t)swar_digits(x, d);
            /* the blank after the comma as a branch (predicted: a body keeps one spacing), not
             * as data on the chain from one number's place to the next */
            p += d + 1;
            if (*p == ' ')
                p++;
            else if ((unsigned)(unsigned char)*p - '0' > 9)
                break; /* another blank (a newline...), or not a number: the byte loop */
#ifdef JW_SIMD
            if (jw_ssse3 && ++run == 8)
                break; /* back to the windows */
#endif
        }
        p = skip_ws(p, stop);
        const char *d0 = p;
        uint64_t v = 0;
        unsigned c;
        while ((c = (unsigned)(unsigned char)*p - '0') <= 9 && p - d0 < 11) {
            v = v * 10 + c;
            p++;
        }
        if (p == d0 || p - d0 > 10 || v >> 32 || (*d0 == '0' && p - d0 > 1) || *p == '.' || *p == 'e' || *p == 'E')
            return NULL;
        out[k++] = (uint32_t)v;
        p = skip_ws(p, stop);
        if (*p == ',') {
            p++;
            continue;
        }
        if (*p == ']') {
            *n = k;
            return p + 1;
        }
        return NULL;
    }
}

static PyObject *array_type; /* array.array, imported on first use */
static PyObject *str_cast, *str_I; /* "cast", "I": memoryview.cast's name and format */

/* The ints of the JSON array whose '[' is at p (a new reference): an array('I'), or where
 * `view` a memoryview of format 'I' over a bytes object (no copy: the fast route's, whose
 * consumers read it as a buffer); Py_None (a new reference) when the text is anything else;
 * NULL with an exception (no memory). stop: as json_uint_array's; *after: the byte after
 * the ']'. The ints are read straight into a bytes object sized for the most the text can
 * hold (each int takes >= 2 bytes with its separator), then cut to what it held. */
static PyObject *
uint_array_of(const char *p, const char *stop, const char **after, int view)
{
    if (array_type == NULL) {
        PyObject *mod = PyImport_ImportModule("array");
        if (mod == NULL)
            return NULL;
        array_type = PyObject_GetAttrString(mod, "array");
        Py_DECREF(mod);
        str_cast = PyUnicode_InternFromString("cast");
        str_I = PyUnicode_InternFromString("I");
        if (array_type == NULL || str_cast == NULL || str_I == NULL) {
            Py_CLEAR(array_type);
            return NULL;
        }
    }
    PyObject *bytes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(((size_t)(stop - p) / 2 + 1) * sizeof(uint32_t)));
    if (bytes == NULL)
        return NULL;
    size_t n;
    *after = json_uint_array(p + 1, stop, (uint32_t *)PyBytes_AS_STRING(bytes), &n);
    if (*after == NULL) {
        Py_DECREF(bytes);
        return Py_NewRef(Py_None);
    }
    if (_PyBytes_Resize(&bytes, (Py_ssize_t)(n * sizeof(uint32_t))) < 0)
        return NULL;
    PyObject *res;
    if (view) {
        PyObject *mv = PyMemoryView_FromObject(bytes);
        PyObject *args[2] = {mv, str_I};
        res = mv == NULL ? NULL : PyObject_VectorcallMethod(str_cast, args, 2, NULL);
        Py_XDECREF(mv);
    } else {
        res = PyObject_CallFunctionObjArgs(array_type, str_I, bytes, NULL);
    }
    Py_DECREF(bytes);
    return res;
}

/* ------------------------------------------------------------------ json_tokens */

static PyObject *
py_json_tokens(PyObject *self, PyObject *raw)
{
    Py_buffer b;
    if (PyObject_GetBuffer(raw, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    const char *p = b.buf, *end = p + b.len, *after = NULL;
    PyObject *res;
    p = skip_ws(p, end);
    end = trim_ws(p, end);
    /* '[' ... ']' with the ']' last: the parser's scans stop at it */
    if (end - p < 2 || *p != '[' || end[-1] != ']')
        res = Py_NewRef(Py_None);
    else if ((res = uint_array_of(p, end - 1, &after, 0)) != NULL && res != Py_None && after != end) {
        Py_SETREF(res, Py_NewRef(Py_None)); /* a ']' before the last one */
    }
    PyBuffer_Release(&b);
    return res;
}

/* ------------------------------------------------------------------ json_request */

/* a JSON string at p ('"' excluded): its end (the closing quote) or NULL for escapes/controls */
static const char *
jr_string_end(const char *p, const char *end)
{
    while (p < end) {
        unsigned char c = (unsigned char)*p;
        if (c == '"')
            return p;
        if (c == '\\' || c < 0x20)
            return NULL;
        p++;
    }
    return NULL;
}

static PyObject *
py_json_request(PyObject *self, PyObject *body)
{
    Py_buffer b;
    if (PyObject_GetBuffer(body, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    const char *p = b.buf, *end = p + b.len;
    PyObject *vals[2] = {NULL, NULL}; /* model, lora_name */
    int seen[3] = {0, 0, 0};
    PyObject *res = NULL, *arr = NULL;
    p = skip_ws(p, end);
    const char *last = trim_ws(p, end);
    if (p >= end || *p != '{' || last - p < 2 || last[-1] != '}')
        goto other;
    p = skip_ws(p + 1, end);
    if (p < end && *p == '}')
        goto other; /* no token_ids */
    for (;;) {
        if (p >= end || *p != '"')
            goto other;
        const char *k0 = p + 1, *k1 = jr_string_end(k0, end);
        if (k1 == NULL)
            goto other;
        size_t kl = (size_t)(k1 - k0);
        int which = kl == 5 && !memcmp(k0, "model", 5) ? 0 : kl == 9 && !memcmp(k0, "lora_name", 9) ? 1
                  : kl == 9 && !memcmp(k0, "token_ids", 9) ? 2 : -1;
        if (which < 0 || seen[which])
            goto other;
        seen[which] = 1;
        p = skip_ws(k1 + 1, end);
        if (p >= end || *p != ':')
            goto other;
        p = skip_ws(p + 1, end);
        if (p >= end)
            goto other;
        if (which < 2) {
            if (end - p >= 4 && !memcmp(p, "null", 4)) {
                p += 4;
            } else if (*p == '"') {
                const char *s1 = jr_string_end(p + 1, end);
                if (s1 == NULL)
                    goto other;
                vals[which] = PyUnicode_DecodeUTF8(p + 1, s1 - (p + 1), NULL);
                if (vals[which] == NULL) { /* invalid UTF-8: msgspec names it */
                    PyErr_Clear();
                    goto other;
                }
                p = s1 + 1;
            } else {
                goto other;
            }
        } else {
            if (*p != '[')
                goto other;
            /* the body's last non-blank byte is '}' (checked above): the parser stops at it */
            const char *after;
            arr = uint_array_of(p, last - 1, &after, 1);
            if (arr == NULL)
                goto done;
            if (arr == Py_None)
                goto other;
            p = after;
        }
        p = skip_ws(p, end);
        if (p < end && *p == ',') {
            p = skip_ws(p + 1, end);
            continue;
        }
        if (p < end && *p == '}') {
            p = skip_ws(p + 1, end);
            break;
        }
        goto other;
    }
    if (p != end || !seen[2] || PyObject_Length(arr) == 0)
        goto other;
    res = PyTuple_Pack(3, vals[0] ? vals[0] : Py_None, vals[1] ? vals[1] : Py_None, arr);
    goto done;
other:
    res = Py_NewRef(Py_None);
done:
    Py_XDECREF(vals[0]);
    Py_XDECREF(vals[1]);
    Py_XDECREF(arr);
    PyBuffer_Release(&b);
    return res;
}
