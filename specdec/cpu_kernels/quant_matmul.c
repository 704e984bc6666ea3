/* Weight-only quantized matmul on the CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 *
 * W is stored in groups of 32 along K, each group with an fp16 scale d and an optional fp16
 * offset mn, w = d * q + mn (the GGUF block types map onto this exactly: Q4_0, Q4_1, Q4_K give
 * 4-bit q, Q5_0, Q5_1, Q8_0 give 8-bit q; see specdec/models/gguf_weights.py):
 *   q8: qs [N, K] int8; q4: qs [N, K/2] uint8, two values a byte.
 *   d, mn: [N, K/32] fp16 bits; mn may be NULL (symmetric).
 * Values are stored in "kernel order" so that one vpdpbusd lane sums 4 values of one group:
 *   - K splits into blocks of 8 groups (256 values) and a tail of pairs of groups (64 values).
 *   - Block position (s, l, i), s = 0..3, l = 0..15, i = 0..3 (position 64 s + 4 l + i) holds
 *     the value at k = 32 (l & 7) + 16 (l >> 3) + 4 s + i of the block. q8 stores positions in
 *     order; q4 stores position 64 s + j in byte 64 (s / 2) + j, low nibble for even s.
 *   - Tail pairs hold values in order; q4 stores value j (0..31) of the pair in byte j's low
 *     nibble and value 32 + j in its high nibble (Q4_K's own order).
 * Activations are quantized into the same order (sd_quantize_rows), so both sides of every dot
 * product line up position by position.
 *
 * Activations are quantized per row and per group of 32 to int8 (xd: the group's scale, xs: the
 * scale times the group's sum of int8 values, for the offset term), as llama.cpp does with its
 * Q8 activations. The integer dot products are exact, so the AVX-512 and the portable builds of
 * this file differ only in the order of float additions.
 *
 * Built twice by specdec/cpu_kernels/build.py: with -DSD_AVX512 (AVX-512 F/BW/VL + VNNI) and
 * without (portable C, vectorised by the compiler for the build machine's ISA). Rows are split
 * between OpenMP threads; the process shares PyTorch's libgomp, so torch.set_num_threads rules.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef SD_AVX512
#include <immintrin.h>
#endif

#define GROUP 32

static inline float fp16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  /* subnormal: normalise */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Storage position of value k of a row (see "kernel order" above). */
static inline int64_t kpos(int64_t k, int64_t K) {
    const int64_t full = (K / 256) * 256;
    if (k >= full) return k;
    const int64_t b = k / 256, r = k % 256, g = r / 32, kk = r % 32;
    const int64_t l = g + 8 * (kk / 16), s = (kk % 16) / 4, i = kk % 4;
    return b * 256 + 64 * s + 4 * l + i;
}

/* Group of the value at storage position p. */
static inline int64_t pos_group(int64_t p, int64_t K) {
    const int64_t full = (K / 256) * 256;
    if (p >= full) return p / 32;
    const int64_t b = p / 256, l = (p % 64) / 4;
    return b * 8 + (l & 7);
}

/* x [M, K] float32 -> xq [M, K] int8 in kernel order, xd [M, K/32], xs [M, K/32]. */
void sd_quantize_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd, float *xs) {
    const int64_t G = K / GROUP;
#pragma omp parallel for schedule(static) if (M * K > (1 << 16))
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < G; g++) {
            const float *src = x + m * K + g * GROUP;
            float amax = 0.0f;
            for (int i = 0; i < GROUP; i++) amax = fmaxf(amax, fabsf(src[i]));
            const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int i = 0; i < GROUP; i++) {
                int v = (int)lrintf(src[i] * inv);
                v = v > 127 ? 127 : (v < -127 ? -127 : v);
                xq[m * K + kpos(g * GROUP + i, K)] = (int8_t)v;
                sum += v;
            }
            xd[m * G + g] = d;
            xs[m * G + g] = d * (float)sum;
        }
    }
}

/* The value at storage position p of a q4 row. */
static inline int q4_at(const uint8_t *wq, int64_t p, int64_t K) {
    const int64_t full = (K / 256) * 256;
    if (p < full) {
        const int64_t b = p / 256, r = p % 256, s = r / 64;
        return (wq[b * 128 + 64 * (s / 2) + r % 64] >> (4 * (s % 2))) & 0xf;
    }
    const int64_t t = p - full, j = t % 64;
    return (wq[full / 2 + (t / 64) * 32 + j % 32] >> (4 * (j / 32))) & 0xf;
}

/* The offset term of row n for input row m: sum over groups of mn[n, g] * xs[m, g]. */
static inline float offset_term(const uint16_t *mn_row, const float *xs_row, int64_t G) {
    float s = 0.0f;
    for (int64_t g = 0; g < G; g++) s += fp16_to_f32(mn_row[g]) * xs_row[g];
    return s;
}

#define MAX_GROUPS 4096 /* K up to 131072 */

#ifndef SD_AVX512

static void rows_portable(int kind, const int8_t *xq, const float *xd, const float *xs, int64_t M,
                          int64_t K, const void *qs, const uint16_t *d, const uint16_t *mn,
                          const float *bias, int64_t n0, int64_t n1, float *y, int64_t ldy) {
    const int64_t G = K / GROUP;
    int32_t dots[MAX_GROUPS];
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t m = 0; m < M; m++) {
            const int8_t *a = xq + m * K;
            memset(dots, 0, sizeof(int32_t) * G);
            if (kind == 4) {
                const uint8_t *wq = (const uint8_t *)qs + n * (K / 2);
                for (int64_t p = 0; p < K; p++) dots[pos_group(p, K)] += q4_at(wq, p, K) * a[p];
            } else {
                const int8_t *wq = (const int8_t *)qs + n * K;
                for (int64_t p = 0; p < K; p++) dots[pos_group(p, K)] += (int32_t)wq[p] * a[p];
            }
            float acc = 0.0f;
            for (int64_t g = 0; g < G; g++)
                acc += fp16_to_f32(d[n * G + g]) * xd[m * G + g] * (float)dots[g];
            if (mn) acc += offset_term(mn + n * G, xs + m * G, G);
            if (bias) acc += bias[n];
            y[m * ldy + n] = acc;
        }
    }
}

static void q4_rows(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K,
                    const uint8_t *qs, const uint16_t *d, const uint16_t *mn, const float *bias,
                    int64_t n0, int64_t n1, float *y, int64_t ldy) {
    rows_portable(4, xq, xd, xs, M, K, qs, d, mn, bias, n0, n1, y, ldy);
}

static void q8_rows(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K,
                    const int8_t *qs, const uint16_t *d, const uint16_t *mn, const float *bias,
                    int64_t n0, int64_t n1, float *y, int64_t ldy) {
    rows_portable(8, xq, xd, xs, M, K, qs, d, mn, bias, n0, n1, y, ldy);
}

int sd_isa(void) { return 0; }

#else /* SD_AVX512 */

#define MB_MAX 8
#ifndef PREFETCH
#define PREFETCH 2048 /* bytes ahead in the weight stream */
#endif

/* Lanes 0-7 take element 2j of a 16-float vector, lanes 8-15 element 2j + 1: the scales of
 * the two groups of tail pair j, laid over the dpbusd lanes that sum each group. */
static inline __m512 pair_lanes(__m512 v16, int j) {
    const __m512i lo = _mm512_set1_epi32(2 * j), hi = _mm512_set1_epi32(2 * j + 1);
    return _mm512_permutexvar_ps(_mm512_mask_blend_epi32(0xff00, lo, hi), v16);
}

static inline __m512 load_h16(const uint16_t *p, int64_t count) {
    const __mmask16 k = count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1);
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
}

static inline __m512 load_f16(const float *p, int64_t count) {
    const __mmask16 k = count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1);
    return _mm512_maskz_loadu_ps(k, p);
}

/* 8 floats repeated in both halves of a vector: a block's group scales over its 16 lanes. */
static inline __m512 dup8(__m256 v) {
    const __m512 w = _mm512_castps256_ps512(v);
    return _mm512_shuffle_f32x4(w, w, 0x44);
}

static inline float offset_term512(const uint16_t *mn_row, const float *xs_row, int64_t G) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g += 16)
        acc = _mm512_fmadd_ps(load_h16(mn_row + g, G - g), load_f16(xs_row + g, G - g), acc);
    return _mm512_reduce_add_ps(acc);
}

/* One weight row against MB (1..8) activation rows; out[m] = sum over groups of
 * d[g] * xd[m, g] * dot(q[g], xq[m, g]). */
static inline void row_dots(int kind, const int8_t *xq, const float *xd, int64_t K,
                            const void *wrow, const uint16_t *drow, int MB, float *out) {
    const int64_t G = K / GROUP, NB = K / 256, P = (K - NB * 256) / 64;
    const __m512i nib = _mm512_set1_epi8(0x0f), zero = _mm512_setzero_si512();
    __m512 fa[MB_MAX];
    for (int m = 0; m < MB; m++) fa[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < NB; b++) {
        __m512i w[4];
        __mmask64 neg[4] = {0, 0, 0, 0};
        if (kind == 4) {
            const uint8_t *src = (const uint8_t *)wrow + b * 128;
            _mm_prefetch((const char *)src + PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)src + PREFETCH + 64, _MM_HINT_T0);
            const __m512i v0 = _mm512_loadu_si512((const void *)src);
            const __m512i v1 = _mm512_loadu_si512((const void *)(src + 64));
            w[0] = _mm512_and_si512(v0, nib);
            w[1] = _mm512_and_si512(_mm512_srli_epi16(v0, 4), nib);
            w[2] = _mm512_and_si512(v1, nib);
            w[3] = _mm512_and_si512(_mm512_srli_epi16(v1, 4), nib);
        } else {
            const int8_t *src = (const int8_t *)wrow + b * 256;
            for (int s = 0; s < 4; s++)
                _mm_prefetch((const char *)src + PREFETCH + 64 * s, _MM_HINT_T0);
            for (int s = 0; s < 4; s++) {
                const __m512i v = _mm512_loadu_si512((const void *)(src + 64 * s));
                w[s] = _mm512_abs_epi8(v);
                neg[s] = _mm512_movepi8_mask(v);
            }
        }
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(drow + 8 * b)));
        for (int m = 0; m < MB; m++) {
            const int8_t *a = xq + m * K + b * 256;
            __m512i acc = zero;
            for (int s = 0; s < 4; s++) {
                __m512i x = _mm512_loadu_si512((const void *)(a + 64 * s));
                if (kind == 8) x = _mm512_mask_sub_epi8(x, neg[s], zero, x);
                acc = _mm512_dpbusd_epi32(acc, w[s], x);
            }
            const __m512 sc = dup8(_mm256_mul_ps(d8, _mm256_loadu_ps(xd + m * G + 8 * b)));
            fa[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), sc, fa[m]);
        }
    }
    /* tail: pairs of groups in natural order */
    const int64_t g0 = NB * 8, full = NB * 256;
    for (int64_t p0 = 0; p0 < P; p0 += 8) {
        const int64_t left = G - g0 - 2 * p0;
        const __m512 d16 = load_h16(drow + g0 + 2 * p0, left);
        __m512 s16[MB_MAX];
        for (int m = 0; m < MB; m++)
            s16[m] = _mm512_mul_ps(d16, load_f16(xd + m * G + g0 + 2 * p0, left));
        const int64_t pe = p0 + 8 < P ? p0 + 8 : P;
        for (int64_t p = p0; p < pe; p++) {
            __m512i w;
            __mmask64 neg = 0;
            if (kind == 4) {
                const __m256i v =
                    _mm256_loadu_si256((const __m256i *)((const uint8_t *)wrow + full / 2 + p * 32));
                const __m256i n4 = _mm256_set1_epi8(0x0f);
                w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, n4)),
                                       _mm256_and_si256(_mm256_srli_epi16(v, 4), n4), 1);
            } else {
                const __m512i v =
                    _mm512_loadu_si512((const void *)((const int8_t *)wrow + full + p * 64));
                w = _mm512_abs_epi8(v);
                neg = _mm512_movepi8_mask(v);
            }
            for (int m = 0; m < MB; m++) {
                __m512i x = _mm512_loadu_si512((const void *)(xq + m * K + full + p * 64));
                if (kind == 8) x = _mm512_mask_sub_epi8(x, neg, zero, x);
                const __m512i dot = _mm512_dpbusd_epi32(zero, w, x);
                fa[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), pair_lanes(s16[m], (int)(p - p0)),
                                        fa[m]);
            }
        }
    }
    for (int m = 0; m < MB; m++) out[m] = _mm512_reduce_add_ps(fa[m]);
}

static inline void rows512(int kind, const int8_t *xq, const float *xd, const float *xs,
                           int64_t M, int64_t K, const void *qs, const uint16_t *d,
                           const uint16_t *mn, const float *bias, int64_t n0, int64_t n1,
                           float *y, int64_t ldy) {
    const int64_t G = K / GROUP, row_bytes = kind == 4 ? K / 2 : K;
    float out[MB_MAX];
    for (int64_t n = n0; n < n1; n++) {
        const void *wrow = (const uint8_t *)qs + n * row_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += MB_MAX) {
            const int MB = M - m0 < MB_MAX ? (int)(M - m0) : MB_MAX;
            if (kind == 4)
                row_dots(4, xq + m0 * K, xd + m0 * G, K, wrow, d + n * G, MB, out);
            else
                row_dots(8, xq + m0 * K, xd + m0 * G, K, wrow, d + n * G, MB, out);
            for (int m = 0; m < MB; m++) {
                float v = out[m];
                if (mn) v += offset_term512(mn + n * G, xs + (m0 + m) * G, G);
                if (bias) v += bias[n];
                y[(m0 + m) * ldy + n] = v;
            }
        }
    }
}

static void q4_rows(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K,
                    const uint8_t *qs, const uint16_t *d, const uint16_t *mn, const float *bias,
                    int64_t n0, int64_t n1, float *y, int64_t ldy) {
    rows512(4, xq, xd, xs, M, K, qs, d, mn, bias, n0, n1, y, ldy);
}

static void q8_rows(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K,
                    const int8_t *qs, const uint16_t *d, const uint16_t *mn, const float *bias,
                    int64_t n0, int64_t n1, float *y, int64_t ldy) {
    rows512(8, xq, xd, xs, M, K, qs, d, mn, bias, n0, n1, y, ldy);
}

int sd_isa(void) { return 512; }

#endif /* SD_AVX512 */

/* Rows of W per OpenMP chunk: enough to amortise the loop, small enough to balance 2 threads. */
#define ROW_CHUNK 16

/* K must be a multiple of 64 (checked by the Python launcher). */
void sd_q4_matmul(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K,
                  const uint8_t *qs, const uint16_t *d, const uint16_t *mn, const float *bias,
                  int64_t N, float *y, int64_t ldy) {
    const int64_t chunks = (N + ROW_CHUNK - 1) / ROW_CHUNK;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * ROW_CHUNK, n1 = n0 + ROW_CHUNK < N ? n0 + ROW_CHUNK : N;
        q4_rows(xq, xd, xs, M, K, qs, d, mn, bias, n0, n1, y, ldy);
    }
}

void sd_q8_matmul(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K,
                  const int8_t *qs, const uint16_t *d, const uint16_t *mn, const float *bias,
                  int64_t N, float *y, int64_t ldy) {
    const int64_t chunks = (N + ROW_CHUNK - 1) / ROW_CHUNK;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * ROW_CHUNK, n1 = n0 + ROW_CHUNK < N ? n0 + ROW_CHUNK : N;
        q8_rows(xq, xd, xs, M, K, qs, d, mn, bias, n0, n1, y, ldy);
    }
}

/* ---- attention over the paged KV cache, one query row at a time ------------------------------
 *
 * Row r attends to the first row_prefix[r] positions of its sequence (read through its block
 * table) and then to the cache slots extra_slots[extra_ptr[r] .. extra_ptr[r + 1]) in order (the
 * tree ancestors of a verification row, and the row itself). Every row is computed on its own, in
 * a fixed order of operations, so a row's result does not depend on which rows share its step: a
 * verified draft token gets bit for bit the attention it would get when decoded alone, which
 * keeps greedy speculative output equal to plain greedy output even where the weights and
 * activations are quantized (a last-bit difference could otherwise flip an int8 rounding).
 *
 * q [T, Hq, D], kc/vc [slots, Hkv, D] float32, out [T, Hq, D]; D a multiple of 16, Hq / Hkv <= 16.
 */
#define LANES 16

static inline float dot_fixed(const float *a, const float *b, int64_t D) {
    float acc[LANES] = {0};
    for (int64_t d = 0; d < D; d += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[d + l] * b[d + l];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

void sd_attention(const float *q, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float *kc,
                  const float *vc, const int32_t *block_tables, int64_t bt_stride, int64_t bs,
                  const int32_t *row_seq, const int32_t *row_prefix, const int64_t *extra_ptr,
                  const int64_t *extra_slots, float scale, float *out) {
    const int64_t g = Hq / Hkv;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < T * Hkv; task++) {
        const int64_t r = task / Hkv, h = task % Hkv;
        const int32_t *table = block_tables + (int64_t)row_seq[r] * bt_stride;
        const int64_t np = row_prefix[r], ne = extra_ptr[r + 1] - extra_ptr[r];
        const int64_t S = np + ne;
        float *s = (float *)malloc(sizeof(float) * (size_t)(S * g > 0 ? S * g : 1));
        const float *qh = q + (r * Hq + h * g) * D;
        for (int64_t i = 0; i < S; i++) {
            const int64_t slot = i < np ? (int64_t)table[i / bs] * bs + i % bs
                                        : extra_slots[extra_ptr[r] + i - np];
            const float *kp = kc + (slot * Hkv + h) * D;
            for (int64_t j = 0; j < g; j++) s[j * S + i] = dot_fixed(qh + j * D, kp, D) * scale;
        }
        for (int64_t j = 0; j < g; j++) {
            float *sj = s + j * S, m = -INFINITY, sum = 0.0f;
            for (int64_t i = 0; i < S; i++) m = fmaxf(m, sj[i]);
            for (int64_t i = 0; i < S; i++) {
                sj[i] = expf(sj[i] - m);
                sum += sj[i];
            }
            const float inv = 1.0f / sum;
            for (int64_t i = 0; i < S; i++) sj[i] *= inv;
        }
        float *o = out + (r * Hq + h * g) * D;
        memset(o, 0, sizeof(float) * (size_t)(g * D));
        for (int64_t i = 0; i < S; i++) {
            const int64_t slot = i < np ? (int64_t)table[i / bs] * bs + i % bs
                                        : extra_slots[extra_ptr[r] + i - np];
            const float *vp = vc + (slot * Hkv + h) * D;
            for (int64_t j = 0; j < g; j++) {
                const float p = s[j * S + i];
                float *oj = o + j * D;
                for (int64_t d = 0; d < D; d++) oj[d] += p * vp[d];
            }
        }
        free(s);
    }
}
