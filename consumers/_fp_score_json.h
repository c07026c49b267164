/* _fp_score_json.h: the service's hot route in C, bytes in (included by _fp_score_pods.h; the
 * answer, bytes out, is _fp_score_answer.h).
 *
 * json_request(body) -> (model, lora_name, tokens) | None
 *     A /v1/score or /v1/pick body of the common shape, read in one pass: a JSON object whose
 *     keys are only "model", "lora_name" (each a string without escapes, or null) and
 *     "token_ids" (a non-empty array of JSON ints in [0, 2**32)), each at most once, nothing
 *     but whitespace after it. tokens: an array('I'). None for ANY other body (other keys,
 *     escapes, floats, leading zeros, duplicates, invalid UTF-8, bad JSON...): the caller then
 *     decodes it with msgspec, which accepts or names the error; whatever this reader accepts,
 *     msgspec's ScoreRequest + token_ids_of read the same values from.
 */

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

/* the value of the 1 to 7 digits at p (8 readable bytes), SWAR: their count, or 0 when the
 * eight bytes start with no digit or are all digits (the byte loop takes those) */
static inline int
jr_digits8(const char *p, uint64_t *out)
{
    uint64_t x;
    memcpy(&x, p, 8);
    /* a byte's top bit set in m: not an ASCII digit (below '0', or above '9' once 0x46 is added) */
    uint64_t m = ((x - 0x3030303030303030ULL) | (x + 0x4646464646464646ULL)) & 0x8080808080808080ULL;
    if (m == 0)
        return 0;
    int n = __builtin_ctzll(m) >> 3;
    if (n == 0)
        return 0;
    /* the n digits, first in the lowest byte, moved to the top: the low bytes become leading zeros */
    uint64_t v = (x - 0x3030303030303030ULL) << (8 * (8 - n));
    v = v * 10 + (v >> 8);
    v = (((v & 0x000000FF000000FFULL) * (100 + (1000000ULL << 32))) +
         (((v >> 16) & 0x000000FF000000FFULL) * (1 + (10000ULL << 32)))) >> 32;
    *out = v;
    return n;
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
    uint32_t *out = NULL;
    size_t n = 0;
    PyObject *res = NULL;
    p = skip_ws(p, end);
    const char *last = end;
    while (last > p && (last[-1] == ' ' || last[-1] == '\t' || last[-1] == '\n' || last[-1] == '\r'))
        last--;
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
            /* each int takes >= 2 chars with its separator */
            out = PyMem_Malloc(((size_t)(end - p) / 2 + 1) * sizeof(uint32_t));
            if (out == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            /* the body's last non-blank byte is '}' (checked above): every loop below stops at
             * it, so they read no bound */
            p = skip_ws(p + 1, end);
            for (;;) {
                const char *d0 = p;
                uint64_t v = 0;
                unsigned c;
                int k = last - p >= 8 ? jr_digits8(p, &v) : 0;
                if (k) {
                    p += k;
                } else {
                    while ((c = (unsigned)(unsigned char)*p - '0') <= 9) {
                        v = v * 10 + c;
                        p++;
                    }
                }
                if (p == d0 || p - d0 > 10 || v >> 32 || (*d0 == '0' && p - d0 > 1) ||
                    *p == '.' || *p == 'e' || *p == 'E')
                    goto other;
                out[n++] = (uint32_t)v;
                if (*p == ',') {
                    p++;
                    if (*p == ' ')
                        p++;
                    else
                        p = skip_ws(p, end);
                    continue;
                }
                p = skip_ws(p, end);
                if (*p == ',') {
                    p = skip_ws(p + 1, end);
                    continue;
                }
                if (*p == ']') {
                    p++;
                    break;
                }
                goto other;
            }
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
    if (p != end || !seen[2] || n == 0)
        goto other;
    PyObject *arr = uint_array(out, n);
    if (arr == NULL)
        goto done;
    res = Py_BuildValue("(OON)", vals[0] ? vals[0] : Py_None, vals[1] ? vals[1] : Py_None, arr);
    goto done;
other:
    res = Py_NewRef(Py_None);
done:
    Py_XDECREF(vals[0]);
    Py_XDECREF(vals[1]);
    PyMem_Free(out);
    PyBuffer_Release(&b);
    return res;
}
