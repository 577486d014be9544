/* dualpath's CPU kernels for the Llama-family forward, fp32 and bf16, on AVX-512.
 *
 * Built once per machine by dualpath/model/kernels.py (cc -O3 -march=native) as a Python
 * extension module (the bindings at the end); every kernel runs on the calling thread (an
 * engine uses one core). On a CPU without AVX-512F the module builds with available() == 0
 * and the model runs torch ops.
 *
 * - rms_norm, add_rms_norm: RMSNorm (optionally after the residual add), rounding where the
 *   torch reference (model/layers.py) rounds: the normalised row to the model dtype, then the
 *   product with the weight.
 * - rope_kv: the rotary embedding of q (in place) and k, and the write of k and v into their
 *   paged-cache slots, in one pass over the new tokens; products and sum rounded as torch's.
 * - silu_mul: down_proj's input, silu(gate) * up, rounded like the reference.
 * - decode_attn: one query per sequence over its paged context (keys read in place, no
 *   gather), fp32 scores and softmax.
 * - prefill_attn: a sequence's queries over its paged context, causal (and windowed), in
 *   tiles of 8 queries x 16 keys with an online softmax (flash attention). With AVX512-BF16
 *   the bf16 kernel computes q.k and p.v with vdpbf16ps: exact bf16 products summed in fp32,
 *   p rounded to bf16 for the second product as torch's CPU flash attention does.
 *
 * - pack_head, embed_rows, head_logits: an output head tied to the embedding table, kept once
 *   in a panel layout (16 vocabulary rows side by side) that the head's GEMM streams and the
 *   embedding look-up reads rows back from.
 *
 * Safety: every buffer is sized from the shape it serves (heap, allocations checked: a failure
 * is MemoryError), and the bindings check every index they are handed (cache slots, block ids,
 * query rows, context lengths, token ids) against the counts they are given before anything is
 * written: IndexError, never a write or read outside the tensors.
 *
 * The file is its own template: the kernels below DP_KERNELS are compiled twice, for float
 * (suffix _f32) and for bf16 (suffix _bf16), with LD/ST (16 lanes as float <-> memory) and
 * RND (round to the type and back).
 */
#ifndef DP_KERNELS
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX512F__
#include <immintrin.h>
#define DP_AVX512 1
#else
#define DP_AVX512 0
#endif
#if DP_AVX512 && defined(__AVX512BF16__)
#define DP_HAVE_BF16_DOT 1
#else
#define DP_HAVE_BF16_DOT 0
#endif


#if DP_AVX512
typedef uint16_t bf16;
typedef __mmask16 mask16;

#define QB 8  /* query rows per prefill tile */
#define KB 16 /* keys per prefill tile: one vector */
#define MAX_DV 8 /* head_dim / 16 <= 8: a head's vectors stay in registers */
/* The shapes the kernels take (kernels.py's CpuKernels.refusal says the same): no buffer has a
 * size fixed below these; the bounds keep a step's scratch within reason. */
#define DP_MAX_HEADS 1024
#define DP_MAX_CONTEXT ((int64_t)1 << 24)
#define HEAD_ROWS 8 /* hidden rows per head-GEMM tile */
#define HEAD_PANELS 3 /* 16-row vocabulary panels per head-GEMM tile */

/* What a binding reports back once it holds the GIL again. */
enum { DP_OK = 0, DP_INDEX, DP_VALUE, DP_NOMEM };
typedef struct {
    int code;
    char msg[240];
} dp_status;

static int dp_fail(dp_status *st, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(st->msg, sizeof st->msg, fmt, ap);
    va_end(ap);
    st->code = code;
    return -1;
}

/* 64-byte aligned heap memory of at least `bytes` (aligned_alloc wants a multiple of the
 * alignment); NULL when there is none. */
static void *dp_alloc(size_t bytes) {
    return aligned_alloc(64, bytes ? (bytes + 63) / 64 * 64 : 64);
}

static int dp_check_heads(dp_status *st, int64_t H, int64_t KVH, int64_t D) {
    if (D < 16 || D > 16 * MAX_DV || D % 16)
        return dp_fail(st, DP_VALUE, "head_dim %lld: the kernels take 16, 32, ... %d",
                       (long long)D, 16 * MAX_DV);
    if (H < 1 || H > DP_MAX_HEADS)
        return dp_fail(st, DP_VALUE, "heads %lld: the kernels take 1 to %d", (long long)H,
                       DP_MAX_HEADS);
    if (KVH < 1 || KVH > H || H % KVH)
        return dp_fail(st, DP_VALUE, "kv_heads %lld do not group heads %lld", (long long)KVH,
                       (long long)H);
    return 0;
}

static int dp_check_slots(dp_status *st, const int64_t *slots, int64_t n, int64_t num_slots,
                          const char *what) {
    for (int64_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= num_slots)
            return dp_fail(st, DP_INDEX, "cache slot %lld of %s %lld is outside the cache's %lld slots",
                           (long long)slots[i], what, (long long)i, (long long)num_slots);
    return 0;
}

/* Decode sequence b reads query row rows[b] (of T) and the blocks of its block table (row b,
 * table_width entries) that hold its last ctx_lens[b] (or window) positions. */
static int dp_check_decode(dp_status *st, const int64_t *rows, int64_t B, int64_t T,
                           const int32_t *table, int64_t table_stride, int64_t table_width,
                           const int32_t *ctx_lens, int64_t bs, int64_t num_blocks,
                           int64_t window) {
    for (int64_t b = 0; b < B; b++) {
        int64_t ctx = ctx_lens[b];
        if (rows[b] < 0 || rows[b] >= T)
            return dp_fail(st, DP_INDEX, "query row %lld of decode sequence %lld is outside the step's %lld rows",
                           (long long)rows[b], (long long)b, (long long)T);
        if (ctx < 1 || ctx > DP_MAX_CONTEXT)
            return dp_fail(st, DP_VALUE, "decode sequence %lld has a context of %lld tokens (1 to %lld)",
                           (long long)b, (long long)ctx, (long long)DP_MAX_CONTEXT);
        if ((ctx + bs - 1) / bs > table_width)
            return dp_fail(st, DP_INDEX, "decode sequence %lld: %lld tokens need %lld blocks, its block table holds %lld",
                           (long long)b, (long long)ctx, (long long)((ctx + bs - 1) / bs), (long long)table_width);
        int64_t lo = window > 0 && ctx > window ? ctx - window : 0;
        for (int64_t blk = lo / bs; blk * bs < ctx; blk++) {
            int64_t id = table[b * table_stride + blk];
            if (id < 0 || id >= num_blocks)
                return dp_fail(st, DP_INDEX, "block %lld (entry %lld of decode sequence %lld's table) is outside the cache's %lld blocks",
                               (long long)id, (long long)blk, (long long)b, (long long)num_blocks);
        }
    }
    return 0;
}

/* A prefill slice: rows q_start.. (q_len of T) at positions pos0.., over ctx context slots. */
static int dp_check_prefill(dp_status *st, int64_t q_start, int64_t q_len, int64_t pos0,
                            int64_t ctx, const int64_t *slots, int64_t T, int64_t num_slots) {
    if (q_start < 0 || q_len < 0 || q_start + q_len > T)
        return dp_fail(st, DP_INDEX, "prefill rows %lld..%lld are outside the step's %lld rows",
                       (long long)q_start, (long long)(q_start + q_len), (long long)T);
    if (ctx > DP_MAX_CONTEXT)
        return dp_fail(st, DP_VALUE, "a context of %lld tokens (the kernels take %lld)",
                       (long long)ctx, (long long)DP_MAX_CONTEXT);
    if (pos0 < 0 || pos0 + q_len > ctx)
        return dp_fail(st, DP_INDEX, "%lld queries from position %lld need %lld context positions, the slice has %lld",
                       (long long)q_len, (long long)pos0, (long long)(pos0 + q_len), (long long)ctx);
    return dp_check_slots(st, slots, ctx, num_slots, "context position");
}

static inline mask16 dp_tail(int64_t left) { return left >= 16 ? (mask16)0xffff : (mask16)((1u << left) - 1u); }

/* fp32 -> bf16, round to nearest even, NaN kept quiet (torch's c10::BFloat16 rule). */
static inline __m256i dp_to_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

static inline __m512 dp_from_bf16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline uint16_t dp_bf16_scalar(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* exp on 16 lanes (Cody-Waite reduction, Cephes' degree-6 polynomial, ~1 ulp); inputs are
 * clamped to [-87, 88]: softmax terms below e^-87 never matter beside the maximum's 1. */
static inline __m512 dp_exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline float dp_exp1(float x) { return _mm512_cvtss_f32(dp_exp16(_mm512_set1_ps(x))); }

/* Zero the packed K and V tiles of ctx keys (whole KB-key tiles, elem bytes a value) before
 * pack_kv fills them: the last tile's unused keys must read as zeros. */
static inline void dp_clear_packed(void *kp, void *vp, int64_t ctx, int64_t D, size_t elem) {
    size_t nbytes = elem * (size_t)(((ctx + KB - 1) / KB) * KB * D);
    memset(kp, 0, nbytes);
    memset(vp, 0, nbytes);
}

#define DP_CAT2(a, b) a##_##b
#define DP_CAT(a, b) DP_CAT2(a, b)
#define NAME(x) DP_CAT(dp_##x, SUF)

#define DP_KERNELS
#define T float
#define SUF f32
#define LDM(p, m) _mm512_maskz_loadu_ps((m), (p))
#define STM(p, m, v) _mm512_mask_storeu_ps((p), (m), (v))
#define LDF(p) _mm512_loadu_ps(p)
#define STF(p, v) _mm512_storeu_ps((p), (v))
#define RND(v) (v)
#include __FILE__
#undef T
#undef SUF
#undef LDM
#undef STM
#undef LDF
#undef STF
#undef RND

#define T bf16
#define SUF bf16
#define LDM(p, m) dp_from_bf16(_mm256_maskz_loadu_epi16((m), (p)))
#define STM(p, m, v) _mm256_mask_storeu_epi16((p), (m), dp_to_bf16(v))
#define LDF(p) dp_from_bf16(_mm256_loadu_si256((const __m256i *)(p)))
#define STF(p, v) _mm256_storeu_si256((__m256i *)(p), dp_to_bf16(v))
#define RND(v) dp_from_bf16(dp_to_bf16(v))
#define DP_BF16_PASS 1
#include __FILE__
#undef T
#undef SUF
#undef LDM
#undef STM
#undef LDF
#undef STF
#undef RND
#undef DP_BF16_PASS
#endif /* DP_AVX512 */

/* ---- the Python module: one function per kernel, arguments as ints (pointers, sizes,
 * strides in elements) and floats; the first says the dtype (0 fp32, 1 bf16). Each call
 * releases the GIL while it computes. -------------------------------------------------------- */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *py_available(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyLong_FromLong(DP_AVX512);
}

static PyObject *py_has_bf16_dot(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyLong_FromLong(DP_HAVE_BF16_DOT);
}

#if DP_AVX512
/* Parse nargs arguments by fmt ('i': int64, 'f': float) into iv / fv; -1 with an exception. */
static int dp_args(PyObject *const *args, Py_ssize_t nargs, const char *fmt, int64_t *iv, double *fv) {
    Py_ssize_t want = (Py_ssize_t)strlen(fmt);
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, nargs);
        return -1;
    }
    for (Py_ssize_t k = 0; k < nargs; k++) {
        if (fmt[k] == 'f') fv[k] = PyFloat_AsDouble(args[k]);
        else iv[k] = PyLong_AsLongLong(args[k]);
    }
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *dp_result(const dp_status *st) {
    switch (st->code) {
    case DP_OK:
        Py_RETURN_NONE;
    case DP_INDEX:
        PyErr_SetString(PyExc_IndexError, st->msg);
        return NULL;
    case DP_VALUE:
        PyErr_SetString(PyExc_ValueError, st->msg);
        return NULL;
    default:
        PyErr_SetString(PyExc_MemoryError, st->msg[0] ? st->msg : "the CPU kernels' scratch");
        return NULL;
    }
}

/* A binding: parse the arguments, run the body without the GIL (it reports through st and
 * must not return), raise what st says. */
#define P(k) ((void *)(intptr_t)a[k])
#define DP_PY(name, fmt, ...)                                                               \
    static PyObject *py_##name(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {  \
        int64_t a[32];                                                                     \
        double f[32];                                                                      \
        dp_status st = {DP_OK, {0}};                                                       \
        (void)self;                                                                        \
        if (dp_args(args, nargs, fmt, a, f) < 0) return NULL;                              \
        Py_BEGIN_ALLOW_THREADS do { __VA_ARGS__ } while (0);                               \
        Py_END_ALLOW_THREADS return dp_result(&st);                                        \
    }
#define DP_BY_DTYPE(fn, ...) \
    if (a[0]) dp_##fn##_bf16(__VA_ARGS__); else dp_##fn##_f32(__VA_ARGS__);
/* A kernel that allocates: MemoryError when it says it could not. */
#define DP_ALLOCATING(fn, ...)                                                            \
    if (a[0] ? dp_##fn##_bf16(__VA_ARGS__) : dp_##fn##_f32(__VA_ARGS__))                  \
        dp_fail(&st, DP_NOMEM, "no memory for the scratch of " #fn);

DP_PY(rms_norm, "iiiiiiiif", DP_BY_DTYPE(rms_norm, P(1), a[2], P(3), P(4), a[5], a[6], a[7], (float)f[8]))
DP_PY(add_rms_norm, "iiiiiiiiiif",
      DP_BY_DTYPE(add_rms_norm, P(1), a[2], P(3), a[4], P(5), P(6), a[7], a[8], a[9], (float)f[10]))
DP_PY(silu_mul, "iiiiiii", DP_BY_DTYPE(silu_mul, P(1), a[2], P(3), a[4], a[5], a[6]))
DP_PY(argmax_rows, "iiiiii", DP_BY_DTYPE(argmax_rows, P(1), a[2], a[3], a[4], P(5)))
/* dtype, qkv, qkv_stride, tokens, H, KVH, D, cos, sin, cache, slots, cache slots */
DP_PY(rope_kv, "iiiiiiiiiiii", {
    if (dp_check_heads(&st, a[4], a[5], a[6]) || dp_check_slots(&st, P(10), a[3], a[11], "token")) break;
    DP_BY_DTYPE(rope_kv, P(1), a[2], a[3], a[4], a[5], a[6], P(7), P(8), P(9), P(10))
})
/* dtype, q, q_stride, rows, cache, block_table, table_stride, ctx_lens, B, H, KVH, D, bs,
 * window, scale, out, out_stride, q rows, table width, cache blocks */
DP_PY(decode_attn, "iiiiiiiiiiiiiifiiiii", {
    if (dp_check_heads(&st, a[9], a[10], a[11]) ||
        dp_check_decode(&st, P(3), a[8], a[17], P(5), a[6], a[18], P(7), a[12], a[19], a[13]))
        break;
    DP_ALLOCATING(decode_attn, P(1), a[2], P(3), P(4), P(5), a[6], P(7), a[8], a[9], a[10],
                  a[11], a[12], a[13], (float)f[14], P(15), a[16])
})
/* dtype, q, q_stride, q_len, q_pos0, cache, slots, ctx, H, KVH, D, window, scale, out,
 * out_stride, cache slots */
DP_PY(prefill_attn, "iiiiiiiiiiiifiii", {
    if (dp_check_heads(&st, a[8], a[9], a[10]) ||
        dp_check_prefill(&st, 0, a[3], a[4], a[7], P(6), a[3], a[15]))
        break;
    DP_ALLOCATING(prefill_attn, P(1), a[2], a[3], a[4], P(5), P(6), a[7], a[8], a[9], a[10],
                  a[11], (float)f[12], P(13), a[14])
})

/* A whole layer's attention: the rotary embedding and KV write of all T tokens, then every
 * prefill slice (meta: [q_start, q_len, pos0, ctx, slot_ids pointer] each) and the decode
 * rows; every index is checked first, so a bad one raises before anything is written.
 * Arguments: dtype, qkv, qkv_stride, T, H, KVH, D, cos, sin, cache, slots, bs, window,
 * scale, out, out_stride, n_prefill, meta, n_decode, rows, block_table, table_stride,
 * ctx_lens, table width, cache blocks. */
DP_PY(attend, "iiiiiiiiiiiiifiiiiiiiiiii", {
    int64_t D = a[6], qs = a[2], os = a[15], T = a[3], num_slots = a[11] * a[24];
    size_t elem = a[0] ? sizeof(bf16) : sizeof(float);
    const int64_t *meta = P(17);
    if (dp_check_heads(&st, a[4], a[5], D) || dp_check_slots(&st, P(10), T, num_slots, "token"))
        break;
    for (int64_t i = 0; i < a[16]; i++) {
        const int64_t *m = meta + 5 * i;
        if (dp_check_prefill(&st, m[0], m[1], m[2], m[3], (const int64_t *)(intptr_t)m[4], T, num_slots))
            break;
    }
    if (st.code || (a[18] && dp_check_decode(&st, P(19), a[18], T, P(20), a[21], a[23], P(22),
                                             a[11], a[24], a[12])))
        break;
    DP_BY_DTYPE(rope_kv, P(1), qs, T, a[4], a[5], D, P(7), P(8), P(9), P(10))
    for (int64_t i = 0; i < a[16] && !st.code; i++) {
        const int64_t *m = meta + 5 * i;
        void *q = (char *)P(1) + (size_t)(m[0] * qs) * elem;
        void *o = (char *)P(14) + (size_t)(m[0] * os) * elem;
        DP_ALLOCATING(prefill_attn, q, qs, m[1], m[2], P(9), (const int64_t *)(intptr_t)m[4],
                      m[3], a[4], a[5], D, a[12], (float)f[13], o, os)
    }
    if (a[18] && !st.code) {
        DP_ALLOCATING(decode_attn, P(1), qs, P(19), P(9), P(20), a[21], P(22), a[18], a[4],
                      a[5], D, a[11], a[12], (float)f[13], P(14), os)
    }
})

/* The tied head. pack_head: dtype, w, w_stride, V, K, P. embed_rows: dtype, P, V, K, ids, n,
 * out, out_stride. head_logits: dtype, x, x_stride, rows, P, V, K, out, out_stride. */
DP_PY(pack_head, "iiiiii", DP_BY_DTYPE(pack_head, P(1), a[2], a[3], a[4], P(5)))
DP_PY(embed_rows, "iiiiiiii", {
    const int64_t *ids = P(4);
    for (int64_t i = 0; i < a[5] && !st.code; i++)
        if (ids[i] < 0 || ids[i] >= a[2])
            dp_fail(&st, DP_INDEX, "token id %lld (input %lld) is outside the vocabulary of %lld",
                    (long long)ids[i], (long long)i, (long long)a[2]);
    if (st.code) break;
    DP_BY_DTYPE(embed_rows, P(1), a[3], ids, a[5], P(6), a[7])
})
DP_PY(head_logits, "iiiiiiiii",
      DP_ALLOCATING(head_logits, P(1), a[2], a[3], P(4), a[5], a[6], P(7), a[8]))
#undef P
#endif /* DP_AVX512 */

#define DP_FAST(name) {#name, (PyCFunction)(void (*)(void))py_##name, METH_FASTCALL, NULL}
static PyMethodDef dp_methods[] = {
    {"available", py_available, METH_NOARGS, NULL},
    {"has_bf16_dot", py_has_bf16_dot, METH_NOARGS, NULL},
#if DP_AVX512
    DP_FAST(rms_norm), DP_FAST(add_rms_norm), DP_FAST(silu_mul), DP_FAST(argmax_rows),
    DP_FAST(rope_kv), DP_FAST(decode_attn), DP_FAST(prefill_attn), DP_FAST(attend),
    DP_FAST(pack_head), DP_FAST(embed_rows), DP_FAST(head_logits),
#endif
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef dp_module = {PyModuleDef_HEAD_INIT, "dualpath_cpu_kernels",
                                       "dualpath's CPU kernels", -1, dp_methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_dualpath_cpu_kernels(void) { return PyModule_Create(&dp_module); }

#else /* DP_KERNELS: the per-dtype kernels */
#define LD(p) LDF(p)
#define ST(p, v) STF((p), (v))

/* out[r] = RND(x[r] / rms(x[r])) * w, rows of n; strides in elements. */
void NAME(rms_norm)(const T *x, int64_t x_stride, const T *w, T *out, int64_t out_stride,
                    int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const T *xr = x + r * x_stride;
        T *o = out + r * out_stride;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            __m512 v = LDM(xr + i, dp_tail(n - i));
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)n + eps));
        for (int64_t i = 0; i < n; i += 16) {
            mask16 m = dp_tail(n - i);
            __m512 t = RND(_mm512_mul_ps(LDM(xr + i, m), inv));
            STM(o + i, m, _mm512_mul_ps(LDM(w + i, m), t));
        }
    }
}

/* x[r] = RND(x[r] + delta[r]) in place, then out[r] = rms_norm(x[r]). */
void NAME(add_rms_norm)(T *x, int64_t x_stride, const T *delta, int64_t d_stride, const T *w,
                        T *out, int64_t out_stride, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        T *xr = x + r * x_stride;
        const T *dr = delta + r * d_stride;
        for (int64_t i = 0; i < n; i += 16) {
            mask16 m = dp_tail(n - i);
            STM(xr + i, m, _mm512_add_ps(LDM(xr + i, m), LDM(dr + i, m)));
        }
    }
    NAME(rms_norm)(x, x_stride, w, out, out_stride, rows, n, eps);
}

/* One head of D values: out = RND(RND(v*cos) + RND(rotate_half(v)*sin)). out may be v. */
static inline void NAME(rotate)(const T *v, const T *c, const T *s, T *out, int64_t D) {
    int64_t half = D / 2;
    __m512 lo[MAX_DV], hi[MAX_DV];
    for (int64_t i = 0, k = 0; i < half; i += 16, k++) {
        mask16 m = dp_tail(half - i);
        __m512 a = LDM(v + i, m), b = LDM(v + half + i, m);
        __m512 ca = LDM(c + i, m), cb = LDM(c + half + i, m);
        __m512 sa = LDM(s + i, m), sb = LDM(s + half + i, m);
        __m512 nb = _mm512_sub_ps(_mm512_setzero_ps(), b);
        lo[k] = _mm512_add_ps(RND(_mm512_mul_ps(a, ca)), RND(_mm512_mul_ps(nb, sa)));
        hi[k] = _mm512_add_ps(RND(_mm512_mul_ps(b, cb)), RND(_mm512_mul_ps(a, sb)));
    }
    for (int64_t i = 0, k = 0; i < half; i += 16, k++) {
        mask16 m = dp_tail(half - i);
        STM(out + i, m, lo[k]);
        STM(out + half + i, m, hi[k]);
    }
}

/* qkv rows [tokens, (H + 2 KVH) D] (row stride qkv_stride): q rotated in place; k rotated and
 * v copied into the cache rows cache[slots[t]] = [2][KVH][D]. cos/sin: [tokens, D]. */
void NAME(rope_kv)(T *qkv, int64_t qkv_stride, int64_t tokens, int64_t H, int64_t KVH,
                   int64_t D, const T *cos, const T *sin, T *cache, const int64_t *slots) {
    for (int64_t t = 0; t < tokens; t++) {
        T *row = qkv + t * qkv_stride;
        const T *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = 0; h < H; h++) NAME(rotate)(row + h * D, c, s, row + h * D, D);
        T *dst = cache + slots[t] * 2 * KVH * D;
        for (int64_t h = 0; h < KVH; h++) NAME(rotate)(row + (H + h) * D, c, s, dst + h * D, D);
        memcpy(dst + KVH * D, row + (H + KVH) * D, (size_t)(KVH * D) * sizeof(T));
    }
}

/* out[r, i] = RND(silu(gu[r, i])) * gu[r, inter + i]. */
void NAME(silu_mul)(const T *gu, int64_t gu_stride, T *out, int64_t out_stride, int64_t rows,
                    int64_t inter) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t r = 0; r < rows; r++) {
        const T *g = gu + r * gu_stride, *u = g + inter;
        T *o = out + r * out_stride;
        for (int64_t i = 0; i < inter; i += 16) {
            mask16 m = dp_tail(inter - i);
            __m512 x = LDM(g + i, m);
            __m512 e = dp_exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            __m512 silu = RND(_mm512_div_ps(x, _mm512_add_ps(one, e)));
            STM(o + i, m, _mm512_mul_ps(silu, LDM(u + i, m)));
        }
    }
}

/* One sequence's decode attention, block by block with an online softmax: each block's rows
 * (every head's k, then every head's v) are first copied whole into `scratch` (a copy streams
 * from memory at several times the rate of the computation's own loads of paged rows), then
 * scored, folded into the running max and sum, and their v weighted into acc. Every per-head
 * buffer (the queries qw, the running max m and sum l, acc) is the caller's, sized by H. */
static inline __attribute__((always_inline)) void NAME(decode_seq_impl)(
    const T *qb, const T *cache, const int32_t *table, int64_t bs, int64_t lo, int64_t ctx,
    int64_t H, int64_t KVH, float scale, T *ob, T *scratch, float *s, __m512 *acc,
    void *qw, float *m, float *l, const int64_t DV) {
    const int64_t D = DV * 16, G = H / KVH, row = 2 * KVH * D;
#if defined(DP_BF16_PASS) && DP_HAVE_BF16_DOT
    const int64_t NC = (DV + 1) / 2; /* chunks of 32 bf16; an odd DV ends on a half chunk */
    const __mmask32 last = DV % 2 ? (__mmask32)0xffff : (__mmask32)0xffffffff;
    __m512bh *qv = qw; /* H * NC */
    for (int64_t h = 0; h < H; h++)
        for (int64_t c = 0; c < NC; c++)
            qv[h * NC + c] = (__m512bh)_mm512_maskz_loadu_epi16(c == NC - 1 ? last : (__mmask32)0xffffffff, qb + h * D + c * 32);
#else
    __m512 *qv = qw; /* H * DV */
    for (int64_t h = 0; h < H; h++)
        for (int64_t v = 0; v < DV; v++) qv[h * DV + v] = LD(qb + h * D + v * 16);
#endif
    for (int64_t h = 0; h < H; h++) m[h] = -INFINITY, l[h] = 0.0f;
    for (int64_t i = 0; i < H * DV; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t blk = lo / bs; blk * bs < ctx; blk++) {
        int64_t l0 = blk * bs > lo ? blk * bs : lo, l1 = (blk + 1) * bs < ctx ? (blk + 1) * bs : ctx;
        int64_t n = l1 - l0;
        memcpy(scratch, cache + ((int64_t)table[blk] * bs + (l0 - blk * bs)) * row,
               (size_t)(n * row) * sizeof(T));
        for (int64_t j = 0; j < n; j++) { /* scores */
            const T *r = scratch + j * row;
            for (int64_t kh = 0; kh < KVH; kh++) {
#if defined(DP_BF16_PASS) && DP_HAVE_BF16_DOT
                __m512bh kv[(MAX_DV + 1) / 2];
                for (int64_t c = 0; c < NC; c++)
                    kv[c] = (__m512bh)_mm512_maskz_loadu_epi16(c == NC - 1 ? last : (__mmask32)0xffffffff, r + kh * D + c * 32);
                for (int64_t g = 0; g < G; g++) {
                    int64_t h = kh * G + g;
                    __m512 a = _mm512_setzero_ps();
                    for (int64_t c = 0; c < NC; c++) a = _mm512_dpbf16_ps(a, qv[h * NC + c], kv[c]);
                    s[h * bs + j] = scale * _mm512_reduce_add_ps(a);
                }
#else
                __m512 kv[MAX_DV];
                for (int64_t v = 0; v < DV; v++) kv[v] = LD(r + kh * D + v * 16);
                for (int64_t g = 0; g < G; g++) {
                    int64_t h = kh * G + g;
                    __m512 a = _mm512_mul_ps(qv[h * DV], kv[0]);
                    for (int64_t v = 1; v < DV; v++) a = _mm512_fmadd_ps(qv[h * DV + v], kv[v], a);
                    s[h * bs + j] = scale * _mm512_reduce_add_ps(a);
                }
#endif
            }
        }
        for (int64_t h = 0; h < H; h++) { /* online softmax */
            float *sh = s + h * bs;
            __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < n; j += 16)
                mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, dp_tail(n - j), sh + j));
            float bm = _mm512_reduce_max_ps(mx), mnew = m[h] > bm ? m[h] : bm;
            float corr = m[h] == -INFINITY ? 0.0f : dp_exp1(m[h] - mnew);
            __m512 mv = _mm512_set1_ps(mnew);
            for (int64_t j = 0; j < n; j += 16) {
                mask16 t = dp_tail(n - j);
                __m512 e = _mm512_maskz_mov_ps(t, dp_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(t, sh + j), mv)));
                _mm512_mask_storeu_ps(sh + j, t, e);
                sum = _mm512_add_ps(sum, e);
            }
            l[h] = l[h] * corr + _mm512_reduce_add_ps(sum);
            m[h] = mnew;
            if (corr != 1.0f) {
                __m512 c = _mm512_set1_ps(corr);
                for (int64_t v = 0; v < DV; v++) acc[h * DV + v] = _mm512_mul_ps(acc[h * DV + v], c);
            }
        }
        for (int64_t j = 0; j < n; j++) { /* values, weighted */
            const T *r = scratch + j * row + KVH * D;
            for (int64_t kh = 0; kh < KVH; kh++) {
                __m512 vv[MAX_DV];
                for (int64_t v = 0; v < DV; v++) vv[v] = LD(r + kh * D + v * 16);
                for (int64_t g = 0; g < G; g++) {
                    int64_t h = kh * G + g;
                    __m512 p = _mm512_set1_ps(s[h * bs + j]);
                    for (int64_t v = 0; v < DV; v++) acc[h * DV + v] = _mm512_fmadd_ps(p, vv[v], acc[h * DV + v]);
                }
            }
        }
    }
    for (int64_t h = 0; h < H; h++) {
        __m512 inv = _mm512_set1_ps(1.0f / l[h]);
        for (int64_t v = 0; v < DV; v++) ST(ob + h * D + v * 16, _mm512_mul_ps(acc[h * DV + v], inv));
    }
}

#define DP_DECODE(N) \
    static void NAME(decode_seq_##N)(const T *qb, const T *cache, const int32_t *table, \
                                     int64_t bs, int64_t lo, int64_t ctx, int64_t H, \
                                     int64_t KVH, float scale, T *ob, T *scratch, float *s, \
                                     __m512 *acc, void *qw, float *m, float *l) { \
        NAME(decode_seq_impl)(qb, cache, table, bs, lo, ctx, H, KVH, scale, ob, scratch, s, acc, \
                              qw, m, l, N); \
    }
DP_DECODE(1)
DP_DECODE(2)
DP_DECODE(3)
DP_DECODE(4)
DP_DECODE(5)
DP_DECODE(6)
DP_DECODE(7)
DP_DECODE(8)
#undef DP_DECODE

/* One query per sequence b, in row rows[b] of q ([H][D] per row, row stride q_stride), over
 * its context of ctx_lens[b] tokens in paged blocks (block_table[b][i], bs tokens each, cache
 * rows [2][KVH][D]); only keys at positions >= ctx - window when window > 0. The result goes
 * to row rows[b] of out (row stride out_stride). Shapes and indices as dp_check_heads and
 * dp_check_decode pass them; -1 when the scratch cannot be allocated (nothing written). */
int NAME(decode_attn)(const T *q, int64_t q_stride, const int64_t *rows, const T *cache,
                      const int32_t *block_table, int64_t table_stride, const int32_t *ctx_lens,
                      int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t window,
                      float scale, T *out, int64_t out_stride) {
    typedef void (*seq_fn)(const T *, const T *, const int32_t *, int64_t, int64_t, int64_t,
                           int64_t, int64_t, float, T *, T *, float *, __m512 *, void *, float *,
                           float *);
    static const seq_fn seqs[MAX_DV + 1] = {
        0, NAME(decode_seq_1), NAME(decode_seq_2), NAME(decode_seq_3), NAME(decode_seq_4),
        NAME(decode_seq_5), NAME(decode_seq_6), NAME(decode_seq_7), NAME(decode_seq_8)};
    size_t head_vectors = sizeof(__m512) * (size_t)(H * (D / 16));
    T *scratch = dp_alloc(sizeof(T) * (size_t)(bs * 2 * KVH * D));
    float *s = dp_alloc(sizeof(float) * (size_t)(H * bs));
    __m512 *acc = dp_alloc(head_vectors);
    void *qw = dp_alloc(head_vectors);
    float *ml = dp_alloc(sizeof(float) * (size_t)(2 * H));
    int ok = scratch && s && acc && qw && ml;
    for (int64_t b = 0; ok && b < B; b++) {
        int64_t ctx = ctx_lens[b], lo = window > 0 && ctx > window ? ctx - window : 0;
        seqs[D / 16](q + rows[b] * q_stride, cache, block_table + b * table_stride, bs, lo, ctx,
                     H, KVH, scale, out + rows[b] * out_stride, scratch, s, acc, qw, ml, ml + H);
    }
    free(scratch);
    free(s);
    free(acc);
    free(qw);
    free(ml);
    return ok ? 0 : -1;
}

/* out[r] = index of the largest value in row r of x [rows, n] (row stride x_stride): the first
 * one on ties, and the first NaN if there is one, as torch.argmax. */
void NAME(argmax_rows)(const T *x, int64_t x_stride, int64_t rows, int64_t n, int64_t *out) {
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t r = 0; r < rows; r++) {
        const T *xr = x + r * x_stride;
        __m512 best = _mm512_set1_ps(-INFINITY);
        __m512i at = _mm512_set1_epi32(INT32_MAX);
        mask16 nan = 0;
        for (int64_t i = 0; i < n; i += 16) {
            mask16 t = dp_tail(n - i);
            __m512 v = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), t, LDM(xr + i, t));
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            /* strictly greater keeps each lane's first maximum; a -inf row still gets an index */
            mask16 gt = _mm512_mask_cmp_ps_mask(t, v, best, _CMP_GT_OQ) |
                        (_mm512_cmpeq_epi32_mask(at, _mm512_set1_epi32(INT32_MAX)) & t);
            best = _mm512_mask_mov_ps(best, gt, v);
            at = _mm512_mask_mov_epi32(at, gt, _mm512_add_epi32(iota, _mm512_set1_epi32((int)i)));
        }
        if (nan) {
            int64_t i = 0;
            while (!isnan(_mm512_cvtss_f32(LDM(xr + i, (mask16)1)))) i++;
            out[r] = i;
            continue;
        }
        float m = _mm512_reduce_max_ps(best);
        mask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
        out[r] = _mm512_mask_reduce_min_epi32(top, at);
    }
}

/* ---- the tied output head: W [V, K] kept once, in panels of 16 vocabulary rows ------------
 * P[v / 16][k / HP][v % 16][k % HP] over K rounded up to HP: fp32 HP = 1, each k a vector of
 * 16 rows; bf16 HP = 2, pairs of k side by side as vdpbf16ps multiplies them. Rows past V and
 * the padding k are zeros. The GEMM streams whole panels; a row is read back in K loads. */
#ifdef DP_BF16_PASS
#define HP 2
#else
#define HP 1
#endif

static inline int64_t NAME(head_at)(int64_t v, int64_t k, int64_t Kp) {
    return ((v / 16 * (Kp / HP) + k / HP) * 16 + v % 16) * HP + k % HP;
}

/* P (ceil(V / 16) * 16 * Kp values, Kp = K rounded up to HP) = W packed (rows of K values,
 * row stride w_stride). */
void NAME(pack_head)(const T *w, int64_t w_stride, int64_t V, int64_t K, T *P) {
    const int64_t Kp = (K + HP - 1) / HP * HP, np = (V + 15) / 16;
    memset(P, 0, sizeof(T) * (size_t)(np * 16 * Kp));
    for (int64_t p = 0; p < np; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t v = p * 16; v < p * 16 + 16 && v < V; v++)
                P[NAME(head_at)(v, k, Kp)] = w[v * w_stride + k];
}

/* out[i] = row ids[i] of W, read from P (the binding checks ids against V). */
void NAME(embed_rows)(const T *P, int64_t K, const int64_t *ids, int64_t n, T *out,
                      int64_t out_stride) {
    const int64_t Kp = (K + HP - 1) / HP * HP;
    for (int64_t i = 0; i < n; i++) {
        T *o = out + i * out_stride;
        for (int64_t k = 0; k < K; k++) o[k] = P[NAME(head_at)(ids[i], k, Kp)];
    }
}

/* The hidden rows as the tile reads them: fp32 rows in place; bf16 rows copied with K padded
 * to even, as pairs of bf16 (vdpbf16ps) or as floats. */
#if defined(DP_BF16_PASS) && DP_HAVE_BF16_DOT
typedef uint32_t NAME(hx);
#else
typedef float NAME(hx);
#endif

/* out[r][v] = RND(x[r] . W[v]) for R hidden rows (row stride xs) and the NV panels from p0,
 * whose R x NV accumulators stay in registers (R and NV are constants where it is inlined). */
static inline __attribute__((always_inline)) void NAME(head_tile)(
    const NAME(hx) *x, int64_t xs, const T *P, int64_t p0, int64_t Kp, T *out, int64_t os,
    int64_t V, const int R, const int NV) {
    const int64_t panel = 16 * Kp;
    const T *w0 = P + p0 * panel;
    __m512 acc[HEAD_ROWS][HEAD_PANELS];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NV; j++) acc[r][j] = _mm512_setzero_ps();
#if defined(DP_BF16_PASS) && DP_HAVE_BF16_DOT
    for (int64_t kp = 0; kp < Kp / 2; kp++) {
        __m512bh w[HEAD_PANELS];
        for (int j = 0; j < NV; j++) w[j] = (__m512bh)_mm512_loadu_si512((const void *)(w0 + j * panel + kp * 32));
        for (int r = 0; r < R; r++) {
            __m512bh b = (__m512bh)_mm512_set1_epi32((int)x[r * xs + kp]);
            for (int j = 0; j < NV; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], b, w[j]);
        }
    }
#elif defined(DP_BF16_PASS)
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t kp = 0; kp < Kp / 2; kp++) {
        __m512 even[HEAD_PANELS], odd[HEAD_PANELS];
        for (int j = 0; j < NV; j++) {
            __m512i wv = _mm512_loadu_si512((const void *)(w0 + j * panel + kp * 32));
            even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
            odd[j] = _mm512_castsi512_ps(_mm512_and_si512(wv, high));
        }
        for (int r = 0; r < R; r++) {
            __m512 b0 = _mm512_set1_ps(x[r * xs + 2 * kp]), b1 = _mm512_set1_ps(x[r * xs + 2 * kp + 1]);
            for (int j = 0; j < NV; j++)
                acc[r][j] = _mm512_fmadd_ps(b1, odd[j], _mm512_fmadd_ps(b0, even[j], acc[r][j]));
        }
    }
#else
    for (int64_t k = 0; k < Kp; k++) {
        __m512 w[HEAD_PANELS];
        for (int j = 0; j < NV; j++) w[j] = _mm512_loadu_ps(w0 + j * panel + k * 16);
        for (int r = 0; r < R; r++) {
            __m512 b = _mm512_set1_ps(x[r * xs + k]);
            for (int j = 0; j < NV; j++) acc[r][j] = _mm512_fmadd_ps(b, w[j], acc[r][j]);
        }
    }
#endif
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NV; j++) {
            int64_t v0 = (p0 + j) * 16;
            STM(out + r * os + v0, dp_tail(V - v0), acc[r][j]);
        }
}

#define DP_TILE(R, NV) \
    case (R) * 4 + (NV): NAME(head_tile)(x, xs, P, p0, Kp, out, os, V, R, NV); break;
#define DP_TILES(R) DP_TILE(R, 1) DP_TILE(R, 2) DP_TILE(R, 3)
static void NAME(head_tiles)(const NAME(hx) *x, int64_t xs, const T *P, int64_t p0, int64_t Kp,
                             T *out, int64_t os, int64_t V, int R, int nv) {
    switch (R * 4 + nv) {
        DP_TILES(1) DP_TILES(2) DP_TILES(3) DP_TILES(4) DP_TILES(5) DP_TILES(6) DP_TILES(7)
        DP_TILES(8)
    }
}
#undef DP_TILES
#undef DP_TILE

/* out [rows, V] (row stride out_stride) = x [rows, K] (row stride x_stride) @ W.T, W packed
 * in P; fp32 sums, rounded once to T as torch's linear does. -1 when the staging of bf16 rows
 * cannot be allocated (nothing written). Panels outer, rows inner: a tile's panels (3 x 16
 * rows of W) stay in cache while every row chunk passes over them. */
int NAME(head_logits)(const T *x, int64_t x_stride, int64_t rows, const T *P, int64_t V,
                      int64_t K, T *out, int64_t out_stride) {
    const int64_t Kp = (K + HP - 1) / HP * HP, np = (V + 15) / 16;
#if defined(DP_BF16_PASS) && DP_HAVE_BF16_DOT
    uint16_t *staged = dp_alloc(sizeof(uint16_t) * (size_t)(rows * Kp));
    if (!staged) return -1;
    for (int64_t r = 0; r < rows; r++) {
        memcpy(staged + r * Kp, x + r * x_stride, sizeof(uint16_t) * (size_t)K);
        if (Kp > K) staged[r * Kp + K] = 0;
    }
    const NAME(hx) *xv = (const uint32_t *)staged;
    const int64_t xs = Kp / 2;
#elif defined(DP_BF16_PASS)
    float *staged = dp_alloc(sizeof(float) * (size_t)(rows * Kp));
    if (!staged) return -1;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t k = 0; k < K; k += 16)
            _mm512_mask_storeu_ps(staged + r * Kp + k, dp_tail(K - k), LDM(x + r * x_stride + k, dp_tail(K - k)));
        if (Kp > K) staged[r * Kp + K] = 0.0f;
    }
    const NAME(hx) *xv = staged;
    const int64_t xs = Kp;
#else
    void *staged = NULL;
    const NAME(hx) *xv = x;
    const int64_t xs = x_stride;
#endif
    for (int64_t p = 0; p < np; p += HEAD_PANELS) {
        int nv = np - p < HEAD_PANELS ? (int)(np - p) : HEAD_PANELS;
        for (int64_t r0 = 0; r0 < rows; r0 += HEAD_ROWS) {
            int R = rows - r0 < HEAD_ROWS ? (int)(rows - r0) : HEAD_ROWS;
            NAME(head_tiles)(xv + r0 * xs, xs, P, p, Kp, out + r0 * out_stride, out_stride, V, R, nv);
        }
    }
    free(staged);
    return 0;
}
#undef HP

/* ---- prefill: blocks of QB queries; their scores over the visible keys, softmax, p.v ------ */

static inline int64_t NAME(first_key)(int64_t p, int64_t window) {
    return window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
}

/* Lanes j..j+15 that fall in [lo, hi). */
static inline mask16 NAME(lanes)(int64_t j, int64_t lo, int64_t hi) {
    int64_t a = lo - j < 0 ? 0 : lo - j, b = hi - j > 16 ? 16 : hi - j;
    if (b <= a) return 0;
    return (mask16)(((1u << b) - 1u) & ~((1u << a) - 1u));
}

/* Each row i of s (width keys from k0; row p0 + i sees keys [first_key, p0 + i]) becomes its
 * unnormalised softmax exp(s - max), 0 outside what the row sees; sums[i] gets the row sum. */
static void NAME(block_softmax)(float *s, int64_t width, int64_t p0, int64_t nq, int64_t k0,
                                int64_t window, float *sums) {
    for (int64_t i = 0; i < nq; i++) {
        float *row = s + i * width;
        int64_t lo = NAME(first_key)(p0 + i, window) - k0, hi = p0 + i + 1 - k0;
        __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < width; j += 16)
            mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, NAME(lanes)(j, lo, hi), row + j));
        __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        for (int64_t j = 0; j < width; j += 16) {
            __m512 e = dp_exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), m));
            e = _mm512_maskz_mov_ps(NAME(lanes)(j, lo, hi), e);
            _mm512_storeu_ps(row + j, e);
            sum = _mm512_add_ps(sum, e);
        }
        sums[i] = _mm512_reduce_add_ps(sum);
    }
}

#if defined(DP_BF16_PASS) && DP_HAVE_BF16_DOT
/* bf16 on vdpbf16ps: K packed per tile of KB keys as [D/2][KB][2] (pairs of d), V as
 * [ctx/2][D][2] (pairs of keys); q pairs and p pairs broadcast as 32-bit words. */
#define PK T
typedef const uint32_t *NAME(qblock)[QB]; /* each query row, as pairs of bf16 */

static inline __attribute__((always_inline)) void NAME(load_queries)(
    const T *q, int64_t q_stride, int64_t i0, int64_t nq, NAME(qblock) rows, float *qf,
    const int64_t DV) {
    (void)qf, (void)DV;
    for (int i = 0; i < QB; i++) rows[i] = (const uint32_t *)(q + (i0 + (i < nq ? i : 0)) * q_stride);
}

/* acc[i] = q_i . k_j for the tile's 16 keys. */
static inline __attribute__((always_inline)) void NAME(tile_scores)(
    NAME(qblock) rows, const float *qf, const PK *kt, __m512 *acc, const int64_t DV) {
    (void)qf;
    for (int i = 0; i < QB; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t dp = 0; dp < DV * 8; dp++) {
        __m512bh kv = (__m512bh)_mm512_loadu_si512((const void *)(kt + dp * 2 * KB));
        for (int i = 0; i < QB; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32((int)rows[i][dp]), kv);
    }
}

/* The probabilities as bf16 (what torch's flash attention multiplies v by), in pb. */
static inline void NAME(round_probs)(const float *s, int64_t width, int64_t nq, uint16_t *pb) {
    for (int64_t i = 0; i < nq; i++)
        for (int64_t j = 0; j < width; j += 16)
            _mm256_storeu_si256((__m256i *)(pb + i * width + j), dp_to_bf16(_mm512_loadu_ps(s + i * width + j)));
}

/* a, c += p.v of rows i and i2 over keys [k0, k0 + n). */
static inline __attribute__((always_inline)) void NAME(pair_values)(
    const float *s, const uint16_t *pb, int64_t width, int64_t i, int64_t i2, const PK *vp,
    int64_t k0, int64_t n, __m512 *a, __m512 *c, const int64_t DV) {
    (void)s;
    const uint32_t *pa = (const uint32_t *)(pb + i * width), *pc = (const uint32_t *)(pb + i2 * width);
    for (int64_t jp = 0; jp < (n + 1) / 2; jp++) {
        const PK *vrow = vp + (k0 / 2 + jp) * DV * 32;
        __m512bh wa = (__m512bh)_mm512_set1_epi32((int)pa[jp]);
        __m512bh wc = (__m512bh)_mm512_set1_epi32((int)pc[jp]);
        for (int64_t v = 0; v < DV; v++) {
            __m512bh vv = (__m512bh)_mm512_loadu_si512((const void *)(vrow + v * 32));
            a[v] = _mm512_dpbf16_ps(a[v], wa, vv);
            c[v] = _mm512_dpbf16_ps(c[v], wc, vv);
        }
    }
}

static void NAME(pack_kv)(const T *cache, const int64_t *slots, int64_t ctx, int64_t KVH,
                          int64_t kh, int64_t D, PK *kp, PK *vp) {
    int64_t row = 2 * KVH * D;
    dp_clear_packed(kp, vp, ctx, D, sizeof(PK));
    for (int64_t j = 0; j < ctx; j++) {
        const uint32_t *k = (const uint32_t *)(cache + slots[j] * row + kh * D);
        const T *v = cache + slots[j] * row + (KVH + kh) * D;
        uint32_t *kt = (uint32_t *)(kp + (j / KB) * KB * D);
        PK *vt = vp + (j / 2) * D * 2 + (j % 2);
        for (int64_t dp = 0; dp < D / 2; dp++) kt[dp * KB + j % KB] = k[dp];
        for (int64_t d = 0; d < D; d++) vt[d * 2] = v[d];
    }
}
#else
/* fp32 (and bf16 without vdpbf16ps, loaded as fp32): K packed per tile as [D][KB], V as
 * [ctx][D]. */
#define PK float
typedef int NAME(qblock)[1]; /* unused: the queries are staged as floats in qf */

static inline __attribute__((always_inline)) void NAME(load_queries)(
    const T *q, int64_t q_stride, int64_t i0, int64_t nq, NAME(qblock) rows, float *qf,
    const int64_t DV) {
    (void)rows;
    for (int i = 0; i < QB; i++)
        for (int64_t v = 0; v < DV; v++)
            _mm512_storeu_ps(qf + (i * DV + v) * 16, i < nq ? LD(q + (i0 + i) * q_stride + v * 16) : _mm512_setzero_ps());
}

static inline __attribute__((always_inline)) void NAME(tile_scores)(
    NAME(qblock) rows, const float *qf, const PK *kt, __m512 *acc, const int64_t DV) {
    (void)rows;
    for (int i = 0; i < QB; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < DV * 16; d++) {
        __m512 kv = _mm512_loadu_ps(kt + d * KB);
        for (int i = 0; i < QB; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(qf[i * DV * 16 + d]), kv, acc[i]);
    }
}

static inline void NAME(round_probs)(const float *s, int64_t width, int64_t nq, uint16_t *pb) {
    (void)s, (void)width, (void)nq, (void)pb; /* fp32 probabilities as they are */
}

static inline __attribute__((always_inline)) void NAME(pair_values)(
    const float *s, const uint16_t *pb, int64_t width, int64_t i, int64_t i2, const PK *vp,
    int64_t k0, int64_t n, __m512 *a, __m512 *c, const int64_t DV) {
    (void)pb;
    const float *pa = s + i * width, *pc = s + i2 * width;
    for (int64_t j = 0; j < n; j++) {
        const PK *vrow = vp + (k0 + j) * DV * 16;
        __m512 wa = _mm512_set1_ps(pa[j]), wc = _mm512_set1_ps(pc[j]);
        for (int64_t v = 0; v < DV; v++) {
            __m512 vv = _mm512_loadu_ps(vrow + v * 16);
            a[v] = _mm512_fmadd_ps(wa, vv, a[v]);
            c[v] = _mm512_fmadd_ps(wc, vv, c[v]);
        }
    }
}

static void NAME(pack_kv)(const T *cache, const int64_t *slots, int64_t ctx, int64_t KVH,
                          int64_t kh, int64_t D, PK *kp, PK *vp) {
    int64_t row = 2 * KVH * D;
    dp_clear_packed(kp, vp, ctx, D, sizeof(PK));
    for (int64_t j = 0; j < ctx; j++) {
        const T *k = cache + slots[j] * row + kh * D, *v = k + KVH * D;
        PK *kt = kp + (j / KB) * KB * D;
        float kf[MAX_DV * 16];
        for (int64_t i = 0; i < D / 16; i++) {
            _mm512_storeu_ps(kf + i * 16, LD(k + i * 16));
            _mm512_storeu_ps(vp + j * D + i * 16, LD(v + i * 16));
        }
        for (int64_t d = 0; d < D; d++) kt[d * KB + j % KB] = kf[d];
    }
}
#endif

/* One head's queries in blocks of QB rows: scores over the keys the block sees, tile by tile;
 * the softmax of each row; then p.v two rows at a time, whose 2 x DV accumulators stay in
 * registers (DV is a constant where this is inlined). */
static inline __attribute__((always_inline)) void NAME(prefill_head_impl)(
    const T *q, int64_t q_stride, int64_t q_len, int64_t q_pos0, const PK *kp, const PK *vp,
    int64_t ctx, int64_t window, float scale, T *out, int64_t out_stride, float *s,
    uint16_t *pb, const int64_t DV) {
    const int64_t ntiles = (ctx + KB - 1) / KB;
    float qf[QB * MAX_DV * 16];
    NAME(qblock) rows;
    for (int64_t i0 = 0; i0 < q_len; i0 += QB) {
        int64_t nq = q_len - i0 < QB ? q_len - i0 : QB, p0 = q_pos0 + i0;
        int64_t t_lo = NAME(first_key)(p0, window) / KB, t_hi = (p0 + nq - 1) / KB;
        if (t_hi >= ntiles) t_hi = ntiles - 1;
        int64_t k0 = t_lo * KB, width = (t_hi - t_lo + 1) * KB;
        NAME(load_queries)(q, q_stride, i0, nq, rows, qf, DV);
        for (int64_t t = t_lo; t <= t_hi; t++) {
            __m512 acc[QB];
            NAME(tile_scores)(rows, qf, kp + t * KB * DV * 16, acc, DV);
            for (int i = 0; i < nq; i++)
                _mm512_storeu_ps(s + i * width + (t - t_lo) * KB, _mm512_mul_ps(acc[i], _mm512_set1_ps(scale)));
        }
        float sums[QB];
        NAME(block_softmax)(s, width, p0, nq, k0, window, sums);
        NAME(round_probs)(s, width, nq, pb);
        for (int64_t i = 0; i < nq; i += 2) {
            int64_t i2 = i + 1 < nq ? i + 1 : i;
            __m512 a[MAX_DV], c[MAX_DV];
            for (int64_t v = 0; v < DV; v++) a[v] = c[v] = _mm512_setzero_ps();
            NAME(pair_values)(s, pb, width, i, i2, vp, k0, p0 + i2 + 1 - k0, a, c, DV);
            __m512 ia = _mm512_set1_ps(1.0f / sums[i]), ic = _mm512_set1_ps(1.0f / sums[i2]);
            for (int64_t v = 0; v < DV; v++) {
                ST(out + (i0 + i) * out_stride + v * 16, _mm512_mul_ps(a[v], ia));
                if (i2 != i) ST(out + (i0 + i2) * out_stride + v * 16, _mm512_mul_ps(c[v], ic));
            }
        }
    }
}

/* prefill_head_impl with the head size a constant, so its accumulators live in registers. */
#define DP_HEAD(N) \
    static void NAME(prefill_head_##N)(const T *q, int64_t qs, int64_t ql, int64_t qp, \
                                       const PK *kp, const PK *vp, int64_t ctx, int64_t w, \
                                       float sc, T *o, int64_t os, float *s, uint16_t *pb) { \
        NAME(prefill_head_impl)(q, qs, ql, qp, kp, vp, ctx, w, sc, o, os, s, pb, N); \
    }
DP_HEAD(1)
DP_HEAD(2)
DP_HEAD(3)
DP_HEAD(4)
DP_HEAD(5)
DP_HEAD(6)
DP_HEAD(7)
DP_HEAD(8)
#undef DP_HEAD

/* One sequence: q_len queries (q rows [H][D], row stride q_stride) at positions q_pos0.. over
 * the ctx tokens of its context, whose cache rows are slots[0..ctx); causal, and windowed when
 * window > 0. out rows [H][D] (row stride out_stride). Shapes and indices as dp_check_heads
 * and dp_check_prefill pass them; -1 when the scratch cannot be allocated (nothing written). */
int NAME(prefill_attn)(const T *q, int64_t q_stride, int64_t q_len, int64_t q_pos0,
                       const T *cache, const int64_t *slots, int64_t ctx, int64_t H,
                       int64_t KVH, int64_t D, int64_t window, float scale, T *out,
                       int64_t out_stride) {
    typedef void (*head_fn)(const T *, int64_t, int64_t, int64_t, const PK *, const PK *,
                            int64_t, int64_t, float, T *, int64_t, float *, uint16_t *);
    static const head_fn heads[MAX_DV + 1] = {
        0, NAME(prefill_head_1), NAME(prefill_head_2), NAME(prefill_head_3),
        NAME(prefill_head_4), NAME(prefill_head_5), NAME(prefill_head_6),
        NAME(prefill_head_7), NAME(prefill_head_8)};
    int64_t G = H / KVH, ntiles = (ctx + KB - 1) / KB, width = ntiles * KB + KB;
    size_t kv_bytes = sizeof(PK) * (size_t)(ntiles * KB * D);
    PK *kp = dp_alloc(kv_bytes), *vp = dp_alloc(kv_bytes);
    float *s = dp_alloc(sizeof(float) * (size_t)(QB * width));
    uint16_t *pb = dp_alloc(sizeof(uint16_t) * (size_t)(QB * width));
    int ok = kp && vp && s && pb;
    for (int64_t kh = 0; ok && kh < KVH; kh++) {
        NAME(pack_kv)(cache, slots, ctx, KVH, kh, D, kp, vp);
        for (int64_t g = 0; g < G; g++) {
            int64_t h = kh * G + g;
            heads[D / 16](q + h * D, q_stride, q_len, q_pos0, kp, vp, ctx, window, scale,
                          out + h * D, out_stride, s, pb);
        }
    }
    free(kp);
    free(vp);
    free(s);
    free(pb);
    return ok ? 0 : -1;
}
#undef PK
#undef LD
#undef ST
#endif /* DP_KERNELS */
