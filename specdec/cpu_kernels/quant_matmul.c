/* Weight-only quantized matmul on the CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 *
 * W is stored in groups of 32 along K, each group with an fp16 scale d and an optional fp16
 * offset mn, w = d * q + mn (the GGUF block types map onto this exactly: Q4_0, Q4_1, Q4_K give
 * 4-bit q, Q5_0, Q5_1 5-bit q, Q8_0 8-bit q; see specdec/models/gguf_weights.py).
 *
 * Layout: "units" of 16 rows x one group (32 values), [N/16][K/32] units in row-block order.
 * A unit is what one AMX B tile holds (8 rows of 64 bytes, VNNI order): tile row r holds
 * values k = 4r .. 4r+3 of the 16 weight rows, byte 4 i + (k % 4) for weight row i.
 *   q8: qs [N/16][K/32][512] int8, the 8 tile rows in order.
 *   q4: qs [N/16][K/32][256] uint8, tile rows 2j and 2j + 1 in the low and high nibbles of
 *       bytes 64 j .. 64 j + 63.
 *   q5: qs [N/16][K/32][320] uint8, the values' low 4 bits as q4 holds them, then their fifth
 *       bits: tile row r's 64 (bit c for byte c of the row) as the little-endian uint64 at
 *       256 + 8 r. 6 bits a weight with d and mn where q8 took 8.5: a Q5_0 layer reads 29%
 *       fewer bytes.
 *   d, mn: [N/16][K/32][16] fp16 bits, one per weight row of the unit; mn may be NULL.
 * With AVX-512 one vpdpbusd multiplies a tile row by 4 activation bytes broadcast to every lane,
 * so each of the 16 lanes sums one weight row: no horizontal reduction anywhere. With AMX
 * (TDPBSUD / TDPBSSD) one instruction does a unit for up to 16 activation rows at once.
 *
 * Activations are quantized per row and per group of 32 to int8 (xd: the group's scale, xs: the
 * scale times the group's sum of int8 values, for the offset term), as llama.cpp does with its
 * Q8 activations. The integer dot products are exact and every path then does the same float
 * operations in the same order (see block_portable), so the portable, AVX-512 and AMX paths
 * give identical results, whatever the number of rows in the call: a row's output never depends
 * on the rows beside it, which keeps speculative greedy output equal to plain greedy output.
 *
 * Built twice by specdec/cpu_kernels/build.py: with -DSD_AVX512 (AVX-512 F/BW/VL + VNNI, and
 * AMX where the CPU and kernel allow it) and without (portable C). Row blocks are split between
 * OpenMP threads, one contiguous run each (sd_parts_matmul); the process shares PyTorch's libgomp,
 * so torch.set_num_threads rules.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "fixed_math.h"
#include "quant_matmul.h"

#if defined(SD_AVX512) || defined(SD_AVX2)
#include <immintrin.h>
#endif
#ifdef SD_AVX512
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define GROUP 32
#define UNIT_ROWS 16

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

/* x [M, K] float32 -> xq [M, K] int8, xd [M, K/32], xs [M, K/32]. */
void sd_quantize_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd, float *xs) {
    const int64_t G = K / GROUP;
#pragma omp parallel for schedule(static) if (M * K > (1 << 16))
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < G; g++) {
            const float *src = x + m * K + g * GROUP;
            int8_t *dst = xq + m * K + g * GROUP;
#ifdef SD_AVX512
            /* The portable loop's result in two vectors of 16: the maximum is exact, the product
             * rounded to float, then to the nearest integer, ties to even (what lrintf does in the
             * default rounding mode), and the integer sum exact; that loop calls lrintf for every
             * value and does not vectorise. */
            const __m512 a0 = _mm512_loadu_ps(src), a1 = _mm512_loadu_ps(src + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0),
                                                                  _mm512_abs_ps(a1)));
            const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            const __m512 vi = _mm512_set1_ps(inv);
            const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
            const __m512i q0 = _mm512_min_epi32(_mm512_max_epi32(
                _mm512_cvtps_epi32(_mm512_mul_ps(a0, vi)), lo), hi);
            const __m512i q1 = _mm512_min_epi32(_mm512_max_epi32(
                _mm512_cvtps_epi32(_mm512_mul_ps(a1, vi)), lo), hi);
            _mm_storeu_si128((__m128i *)dst, _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(dst + 16), _mm512_cvtepi32_epi8(q1));
            const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
            float amax = 0.0f;
            for (int i = 0; i < GROUP; i++) amax = fmaxf(amax, fabsf(src[i]));
            const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int i = 0; i < GROUP; i++) {
                int v = (int)lrintf(src[i] * inv);
                v = v > 127 ? 127 : (v < -127 ? -127 : v);
                dst[i] = (int8_t)v;
                sum += v;
            }
#endif
            xd[m * G + g] = d;
            xs[m * G + g] = d * (float)sum;
        }
    }
}

/* Bytes of one unit of `kind` (4, 5 or 8 bits a value). */
static inline int64_t unit_bytes(int64_t kind) { return kind == 4 ? 256 : kind == 5 ? 320 : 512; }

/* The value of weight row i (0..15), column k (0..31) of a unit. */
static inline int unit_value(int kind, const void *unit, int i, int k) {
    const int r = k / 4, c = 4 * i + k % 4;
    const uint8_t *u = (const uint8_t *)unit;
    if (kind == 8) return ((const int8_t *)unit)[r * 64 + c];
    const int low = (u[(r / 2) * 64 + c] >> (4 * (r % 2))) & 0xf;
    return kind == 5 ? low | ((u[256 + 8 * r + c / 8] >> (c % 8)) & 1) << 4 : low;
}

/* Every path computes, per output (m, n), in group order g = 0, 1, ...:
 *     acc = fma((float)dot_g, d_g * xd_g, acc);  acc = fma(mn_g, xs_g, acc)   (if mn)
 * then adds the bias: the same float operations in the same order, whichever path runs and
 * however many rows share the call. */
static void block_portable(int kind, const int8_t *xq, const float *xd, const float *xs,
                           int64_t M, int64_t K, const void *qs, const uint16_t *d,
                           const uint16_t *mn, const float *bias, int64_t nb, float *y,
                           int64_t ldy) {
    const int64_t G = K / GROUP, ub = unit_bytes(kind);
    for (int64_t m = 0; m < M; m++) {
        float acc[UNIT_ROWS] = {0};
        for (int64_t g = 0; g < G; g++) {
            const int64_t u = nb * G + g;
            const void *unit = (const uint8_t *)qs + u * ub;
            const int8_t *a = xq + m * K + g * GROUP;
            const float sx = xd[m * G + g];
            for (int i = 0; i < UNIT_ROWS; i++) {
                int32_t dot = 0;
                for (int k = 0; k < GROUP; k++) dot += unit_value(kind, unit, i, k) * a[k];
                acc[i] = fmaf((float)dot, fp16_to_f32(d[u * 16 + i]) * sx, acc[i]);
                if (mn) acc[i] = fmaf(fp16_to_f32(mn[u * 16 + i]), xs[m * G + g], acc[i]);
            }
        }
        for (int i = 0; i < UNIT_ROWS; i++)
            y[m * ldy + nb * 16 + i] = bias ? acc[i] + bias[nb * 16 + i] : acc[i];
    }
}

#if defined(SD_AVX512) || defined(SD_AVX2)
#ifndef PREFETCH
#define PREFETCH 2048 /* bytes ahead in the weight stream */
#endif
#ifndef PREFETCH_HINT
/* Into L1. Into L2 (_MM_HINT_T1) 8-32 KB ahead read 15-29% faster at one row on lone matrices
 * (cpu_matmul_ab.py) but made the 1.5b's decode pass 12% slower in the engine
 * (bench/results/cpu_kernel_ab_model_20261207_prefetch_l2.json). */
#define PREFETCH_HINT _MM_HINT_T0
#endif

static inline void prefetch_unit(const uint8_t *unit, int64_t bytes) {
    for (int64_t line = 0; line < bytes / 64; line++)
        _mm_prefetch((const char *)unit + PREFETCH + 64 * line, PREFETCH_HINT);
}
#endif

#ifndef SD_AVX512

static int use_amx(int64_t M) { (void)M; return 0; }

#ifdef SD_AVX2
/* ---- AVX2 (+ FMA, F16C): CPUs without AVX-512, most laptops' among them ----
 *
 * A unit's tile row is 64 bytes, two 256-bit halves: weight rows 0-7 and 8-15, each half its own
 * 8 float accumulators per activation row. Activations come spread (spread_rows: each tile row's
 * 4 bytes repeated across a register, built once a call), rows up to three at a time, each tile
 * row unpacked once and used at once by all of them, so that what stays live nearly fits the 16
 * registers (with the accumulators on the stack, a decode step of the 1.5b took 51 ms against 40
 * with them in registers: bench/investigations/cpu_kernel_ab_model.py; three rows at a time
 * rather than two, 3-row passes 5-13% and 5-row passes 4-8% faster on the 1.5b's shapes:
 * bench/results/cpu_matmul_ab_20261207_avx2_mb3.txt). vpmaddubsw multiplies unsigned by signed
 * bytes, summing pairs into int16, and vpmaddwd by ones sums those into int32: the VNNI step in
 * two instructions. Its int16 sums must not saturate: a q4 pair is at most 2 * 15 * 127 = 3810,
 * so all 8 tile rows' pairs add up in int16 (30480); a q5 pair 7874, 4 of them (31496); a q8
 * weight row is signed, so it is taken as |w| (unsigned) against the activation given w's sign
 * (vpsignb), a pair at most 2 * 128 * 127 = 32512, each widened on its own. The integer dot
 * products are exact, then the float operations are block_portable's, in its order: the same
 * results as every other path. */
static inline __m256 h8(const uint16_t *p) {  /* 8 fp16 values -> floats */
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* Byte c (0..31) all ones where bit c of m is set. */
static inline __m256i bit_bytes(uint32_t m) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

/* The fifth bits of tile row r's half h (q5): 16 where set, else 0. */
static inline __m256i fifth_bits(const uint8_t *unit, int r, int h) {
    uint32_t m;
    memcpy(&m, unit + 256 + 8 * r + 4 * h, 4);
    return _mm256_and_si256(bit_bytes(m), _mm256_set1_epi8(16));
}

/* MB activation rows' integer dot products with half h of a unit: acc[m] gets 8 int32, one a
 * weight row. xb: row 0's group as spread_rows lays it out (tile row r's 4 bytes repeated at
 * 32 r), row m's K * 8 bytes further on. Each tile row is unpacked once and used at once by
 * every row, so few registers stay live. */
static inline __attribute__((always_inline)) void dot_half(
        const int kind, const int MB, const uint8_t *unit, int h, const int8_t *xb, int64_t K,
        __m256i acc[3]) {
    const __m256i ones = _mm256_set1_epi16(1);
#define X(m, r) _mm256_load_si256((const __m256i *)(xb + (m) * K * 8 + 32 * (r)))
    if (kind == 8) {
        for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_si256();
        for (int r = 0; r < 8; r++) {
            const __m256i sw = _mm256_loadu_si256((const __m256i *)(unit + 64 * r + 32 * h));
            const __m256i aw = _mm256_abs_epi8(sw);
            for (int m = 0; m < MB; m++)
                acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(
                    _mm256_maddubs_epi16(aw, _mm256_sign_epi8(X(m, r), sw)), ones));
        }
        return;
    }
    const __m256i nib = _mm256_set1_epi8(0x0f);
    __m256i s[3];
    for (int m = 0; m < MB; m++) s[m] = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(unit + 64 * j + 32 * h));
        __m256i w0 = _mm256_and_si256(v, nib), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        if (kind == 5) {
            w0 = _mm256_add_epi8(w0, fifth_bits(unit, 2 * j, h));
            w1 = _mm256_add_epi8(w1, fifth_bits(unit, 2 * j + 1, h));
        }
        for (int m = 0; m < MB; m++) {
            const __m256i p0 = _mm256_maddubs_epi16(w0, X(m, 2 * j));
            const __m256i p1 = _mm256_maddubs_epi16(w1, X(m, 2 * j + 1));
            s[m] = _mm256_add_epi16(s[m], _mm256_add_epi16(p0, p1));
        }
        if (kind == 5 && j == 1)  /* 4 tile rows: as far as q5's pairs may add up in int16 */
            for (int m = 0; m < MB; m++) {
                acc[m] = _mm256_madd_epi16(s[m], ones);
                s[m] = _mm256_setzero_si256();
            }
    }
    for (int m = 0; m < MB; m++)
        acc[m] = kind == 5 ? _mm256_add_epi32(acc[m], _mm256_madd_epi16(s[m], ones))
                           : _mm256_madd_epi16(s[m], ones);
#undef X
}

/* x [M, K] int8 -> [M, K / 4, 32]: each 4 bytes (a tile row's activations) repeated 8 times,
 * what vpmaddubsw takes against a tile row's half; built once a call, read by every block. */
static int8_t *spread_rows(const int8_t *x, int64_t M, int64_t K) {
    int8_t *out = aligned_alloc(32, (size_t)(M * K * 8));
    if (out == NULL) abort();
    for (int64_t i = 0; i < M * K / 4; i++) {
        int32_t v;
        memcpy(&v, x + 4 * i, 4);
        _mm256_store_si256((__m256i *)(out + 32 * i), _mm256_set1_epi32(v));
    }
    return out;
}

/* MB (1 to 3) rows of xb (laid out by spread_rows) against row block nb: both halves of each
 * unit in turn, each row's two accumulators (8 outputs each) in registers. Inlined with kind and
 * MB constant (block_avx2's cases). */
static inline __attribute__((always_inline)) void block_avx2_rows(
        const int kind, const int MB, const int8_t *xb, const float *xd, const float *xs,
        int64_t K, const void *qs, const uint16_t *d, const uint16_t *mn, const float *bias,
        int64_t nb, float *y, int64_t ldy) {
    const int64_t G = K / GROUP, ub = unit_bytes(kind);
    __m256 fa[3][2];
    for (int m = 0; m < MB; m++) fa[m][0] = fa[m][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int64_t u = nb * G + g;
        const uint8_t *unit = (const uint8_t *)qs + u * ub;
        prefetch_unit(unit, ub);
        for (int h = 0; h < 2; h++) {
            __m256i dot[3];
            dot_half(kind, MB, unit, h, xb + g * 256, K, dot);
            const __m256 d8 = h8(d + u * 16 + 8 * h);
            const __m256 mn8 = mn ? h8(mn + u * 16 + 8 * h) : _mm256_setzero_ps();
            for (int m = 0; m < MB; m++) {
                fa[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]), _mm256_mul_ps(
                    d8, _mm256_set1_ps(xd[m * G + g])), fa[m][h]);
                if (mn) fa[m][h] = _mm256_fmadd_ps(mn8, _mm256_set1_ps(xs[m * G + g]), fa[m][h]);
            }
        }
    }
    for (int m = 0; m < MB; m++)
        for (int h = 0; h < 2; h++) {
            float *out = y + m * ldy + nb * 16 + 8 * h;
            _mm256_storeu_ps(out, bias ? _mm256_add_ps(
                fa[m][h], _mm256_loadu_ps(bias + nb * 16 + 8 * h)) : fa[m][h]);
        }
}

#define ROWS_AVX2(KIND, MB) \
    block_avx2_rows(KIND, MB, xb + m0 * K * 8, xd + m0 * G, xs + m0 * G, K, qs, d, mn, bias, nb, \
                    y + m0 * ldy, ldy)

/* M rows of xb (laid out by spread_rows) against row block nb, three at a time (4 as 2 + 2). */
static void block_avx2(int kind, const int8_t *xb, const float *xd, const float *xs, int64_t M,
                       int64_t K, const void *qs, const uint16_t *d, const uint16_t *mn,
                       const float *bias, int64_t nb, float *y, int64_t ldy) {
    const int64_t G = K / GROUP;
    for (int64_t m0 = 0; m0 < M;) {
        const int64_t left = M - m0;
        const int mb = left == 4 || left == 2 ? 2 : left >= 3 ? 3 : 1;
        if (kind == 4) {
            if (mb == 3) ROWS_AVX2(4, 3); else if (mb == 2) ROWS_AVX2(4, 2); else ROWS_AVX2(4, 1);
        } else if (kind == 5) {
            if (mb == 3) ROWS_AVX2(5, 3); else if (mb == 2) ROWS_AVX2(5, 2); else ROWS_AVX2(5, 1);
        } else {
            if (mb == 3) ROWS_AVX2(8, 3); else if (mb == 2) ROWS_AVX2(8, 2); else ROWS_AVX2(8, 1);
        }
        m0 += mb;
    }
}
#undef ROWS_AVX2
#endif /* SD_AVX2 */

static void block_rows(int kind, const int8_t *xq, const float *xd, const float *xs, int64_t M,
                       int64_t K, const void *qs, const uint16_t *d, const uint16_t *mn,
                       const float *bias, int64_t nb, float *y, int64_t ldy, int amx) {
    (void)amx;
#ifdef SD_AVX2
    /* xq as spread_rows laid it out (sd_parts_matmul) */
    block_avx2(kind, xq, xd, xs, M, K, qs, d, mn, bias, nb, y, ldy);
#else
    block_portable(kind, xq, xd, xs, M, K, qs, d, mn, bias, nb, y, ldy);
#endif
}

static int offset_q8(int kind, int path, int amx) { (void)kind; (void)path; (void)amx; return 0; }

int sd_amx_enable(void) { return 0; }

#else /* SD_AVX512 */

#define MB_MAX 8

/* q5: 16 added to each byte of the 8 tile rows whose fifth bit is set. */
static inline void add_fifth_bits(const void *unit, __m512i w[8]) {
    const uint8_t *bits = (const uint8_t *)unit + 256;
    const __m512i sixteen = _mm512_set1_epi8(16);
    for (int r = 0; r < 8; r++) {
        uint64_t m;
        memcpy(&m, bits + 8 * r, 8);
        w[r] = _mm512_mask_add_epi8(w[r], (__mmask64)m, w[r], sixteen);
    }
}

/* The unit's 8 tile rows as 64 bytes each (q4, q5: nibbles spread to bytes). */
static inline void unit_rows(int kind, const void *unit, __m512i w[8]) {
    if (kind == 8) {
        for (int r = 0; r < 8; r++) w[r] = _mm512_loadu_si512((const uint8_t *)unit + 64 * r);
        return;
    }
    const __m512i nib = _mm512_set1_epi8(0x0f);
    for (int j = 0; j < 4; j++) {
        const __m512i v = _mm512_loadu_si512((const uint8_t *)unit + 64 * j);
        w[2 * j] = _mm512_and_si512(v, nib);
        w[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
    }
    if (kind == 5) add_fifth_bits(unit, w);
}

static inline __m512 h16(const uint16_t *p) {  /* 16 fp16 values -> floats */
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* One group's contribution, in block_portable's order: fma(dot, d * xd), then fma(mn, xs). */
static inline __m512 add_group(__m512 fa, __m512i dot, __m512 d16, __m512 mn16, int has_mn,
                               float sx, float sxs) {
    fa = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d16, _mm512_set1_ps(sx)), fa);
    return has_mn ? _mm512_fmadd_ps(mn16, _mm512_set1_ps(sxs), fa) : fa;
}

/* The 16 outputs of row block nb for MB activation rows, plus the bias. */
static inline void store_rows(const __m512 *fa, int MB, const float *bias, int64_t nb,
                              float *y, int64_t ldy) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + nb * 16) : _mm512_setzero_ps();
    for (int m = 0; m < MB; m++)
        _mm512_storeu_ps(y + m * ldy + nb * 16, bias ? _mm512_add_ps(fa[m], b) : fa[m]);
}

/* AVX-512: M activation rows against one 16-row block, MB_MAX rows per pass over the block's
 * units. q8 takes the activations offset to unsigned (xa = x + 128, see matmul): vpdpbusd
 * multiplies unsigned by signed bytes, and 128 * (each weight row's sum), the same for every
 * row, comes off once per unit. q4 and q5 take the signed activations against their unsigned
 * values. */
static void block_avx(int kind, const int8_t *xa, const float *xd, const float *xs, int64_t M,
                      int64_t K, const void *qs, const uint16_t *d, const uint16_t *mn,
                      const float *bias, int64_t nb, float *y, int64_t ldy) {
    const int64_t G = K / GROUP, ub = unit_bytes(kind);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t m0 = 0; m0 < M; m0 += MB_MAX) {
        const int MB = M - m0 < MB_MAX ? (int)(M - m0) : MB_MAX;
        __m512 fa[MB_MAX];
        for (int m = 0; m < MB; m++) fa[m] = _mm512_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
            const int64_t u = nb * G + g;
            const uint8_t *unit = (const uint8_t *)qs + u * ub;
            prefetch_unit(unit, ub);
            __m512i w[8];
            unit_rows(kind, unit, w);
            __m512i corr = _mm512_setzero_si512();  /* q8: 128 * (sum of each row's values) */
            if (kind == 8)
                for (int r = 0; r < 8; r++) corr = _mm512_dpbusd_epi32(corr, flip, w[r]);
            const __m512 d16 = h16(d + u * 16);
            const __m512 mn16 = mn ? h16(mn + u * 16) : _mm512_setzero_ps();
            for (int m = 0; m < MB; m++) {
                const int8_t *a = xa + (m0 + m) * K + g * GROUP;
                /* Two chains of 4 (a vpdpbusd waits 4 cycles for its accumulator, and issues
                 * one a cycle: bench/investigations/cpu_vnni_rate.py); integer sums, so the
                 * same result as one chain of 8. At 5 rows 5-6% faster than one chain, at 8
                 * 1-5%, the same at one row
                 * (bench/results/cpu_matmul_ab_20261207_two_chains.txt). */
                __m512i acc = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
                for (int r = 0; r < 8; r += 2) {
                    const __m512i x = _mm512_set1_epi32(*(const int32_t *)(a + 4 * r));
                    const __m512i x1 = _mm512_set1_epi32(*(const int32_t *)(a + 4 * r + 4));
                    acc = kind != 8 ? _mm512_dpbusd_epi32(acc, w[r], x)
                                    : _mm512_dpbusd_epi32(acc, x, w[r]);
                    acc1 = kind != 8 ? _mm512_dpbusd_epi32(acc1, w[r + 1], x1)
                                     : _mm512_dpbusd_epi32(acc1, x1, w[r + 1]);
                }
                acc = _mm512_add_epi32(acc, acc1);
                if (kind == 8) acc = _mm512_sub_epi32(acc, corr);
                fa[m] = add_group(fa[m], acc, d16, mn16, mn != NULL, xd[(m0 + m) * G + g],
                                  xs[(m0 + m) * G + g]);
            }
        }
        store_rows(fa, MB, bias, nb, y + m0 * ldy, ldy);
    }
}

/* ---- AMX: 16 activation rows x one unit per tile instruction ---- */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int amx_state = -1; /* -1 unknown, 0 unavailable, 1 enabled */

/* Ask the kernel for the AMX tile state (Linux >= 5.16). 1 when AMX can be used. */
int sd_amx_enable(void) {
    if (amx_state < 0) {
        unsigned eax, ebx, ecx, edx;
        __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
        const int has = (edx >> 24) & 1 && (edx >> 25) & 1; /* AMX-TILE, AMX-INT8 */
        amx_state = has && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return amx_state;
}

static int use_amx(int64_t M) { return M >= 2 && amx_state == 1; }

__attribute__((target("amx-tile,amx-int8")))
static void tile_setup(int rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    c.rows[0] = (uint8_t)rows; c.colsb[0] = 64; /* C: rows x 16 int32 */
    c.rows[1] = (uint8_t)rows; c.colsb[1] = 32; /* A: rows x 32 int8 */
    c.rows[2] = 8; c.colsb[2] = 64;             /* B: one unit */
    _tile_loadconfig(&c);
}

__attribute__((target("amx-tile,amx-int8")))
static void block_amx(int kind, const int8_t *xq, const float *xd, const float *xs, int64_t M,
                      int64_t K, const void *qs, const uint16_t *d, const uint16_t *mn,
                      const float *bias, int64_t nb, float *y, int64_t ldy) {
    const int64_t G = K / GROUP, ub = unit_bytes(kind);
    uint8_t bt[512] __attribute__((aligned(64)));
    int32_t cbuf[16 * 16] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
        const int MB = M - m0 < 16 ? (int)(M - m0) : 16;
        tile_setup(MB);
        __m512 fa[16];
        for (int m = 0; m < MB; m++) fa[m] = _mm512_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
            const int64_t u = nb * G + g;
            const uint8_t *unit = (const uint8_t *)qs + u * ub;
            prefetch_unit(unit, ub);
            _tile_zero(0);
            _tile_loadd(1, xq + m0 * K + g * GROUP, K);
            if (kind != 8) {
                __m512i w[8];
                unit_rows(kind, unit, w);
                for (int r = 0; r < 8; r++) _mm512_store_si512(bt + 64 * r, w[r]);
                _tile_loadd(2, bt, 64);
                _tile_dpbsud(0, 1, 2);
            } else {
                _tile_loadd(2, unit, 64);
                _tile_dpbssd(0, 1, 2);
            }
            _tile_stored(0, cbuf, 64);
            const __m512 d16 = h16(d + u * 16);
            const __m512 mn16 = mn ? h16(mn + u * 16) : _mm512_setzero_ps();
            for (int m = 0; m < MB; m++) {
                const __m512i acc = _mm512_load_si512(cbuf + 16 * m);
                fa[m] = add_group(fa[m], acc, d16, mn16, mn != NULL, xd[(m0 + m) * G + g],
                                  xs[(m0 + m) * G + g]);
            }
        }
        store_rows(fa, MB, bias, nb, y + m0 * ldy, ldy);
    }
}

static void block_rows(int kind, const int8_t *xq, const float *xd, const float *xs, int64_t M,
                       int64_t K, const void *qs, const uint16_t *d, const uint16_t *mn,
                       const float *bias, int64_t nb, float *y, int64_t ldy, int amx) {
    if (amx)
        block_amx(kind, xq, xd, xs, M, K, qs, d, mn, bias, nb, y, ldy);
    else
        block_avx(kind, xq, xd, xs, M, K, qs, d, mn, bias, nb, y, ldy);
}

/* Whether block_avx runs, on q8 weights: it takes the activations offset to unsigned. */
static int offset_q8(int kind, int path, int amx) { return kind == 8 && path != 0 && !amx; }

#endif /* SD_AVX512 */

/* Activation rows per pass over the weights: their int8 copies stay in the L2 cache (spread
 * to 8 bytes a value for AVX2). */
#ifdef SD_AVX2
#define M_CHUNK 32
#else
#define M_CHUNK 128
#endif

/* The bytes of one row block of a part (its units, scales and offsets): what a thread streams. */
static int64_t block_bytes(const sd_part *w, int64_t K) {
    const int64_t G = K / GROUP;
    return G * (unit_bytes(w->kind) + 2 * UNIT_ROWS * (w->mn ? 2 : 1));
}

/* y[M, sum of the parts' n] = x @ [W_0; W_1; ..]^T (+ bias): the parts side by side along the
 * output, all of them in one parallel region (one fork and one join for q, k and v together).
 * Each thread takes one contiguous run of row blocks across the parts, the runs cut at equal
 * bytes (a q8 block streams twice a q4 block's), so that the threads finish together. */
void sd_parts_matmul(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K,
                     const sd_part *parts, int64_t nparts, const float *bias, float *y,
                     int64_t ldy, int path) {
    /* path: 0 portable, 1 AVX-512, 2 AMX where it serves this row count */
    int64_t first[SD_MAX_PARTS + 1], bytes[SD_MAX_PARTS + 1];
    first[0] = 0, bytes[0] = 0;
    int any_q8 = 0;
    if (nparts < 1 || nparts > SD_MAX_PARTS) abort();  /* cpu_layers.py checks first */
    for (int64_t p = 0; p < nparts; p++) {
        first[p + 1] = first[p] + parts[p].n / UNIT_ROWS;
        bytes[p + 1] = bytes[p] + (parts[p].n / UNIT_ROWS) * block_bytes(&parts[p], K);
        any_q8 |= parts[p].kind == 8;
    }
    const int64_t G = K / GROUP, total = bytes[nparts];
    for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
        const int64_t mc = M - m0 < M_CHUNK ? M - m0 : M_CHUNK;
        const int amx = path == 2 && use_amx(mc);
        const int8_t *xa = xq + m0 * K;
        int8_t *spread = NULL;
#ifdef SD_AVX2
        if (path != 0) xa = spread = spread_rows(xa, mc, K);
#endif
        int8_t *offset = NULL;  /* x + 128 as unsigned bytes: one xor per byte */
        if (any_q8 && offset_q8(8, path, amx)) {
            offset = malloc((size_t)(mc * K));
            if (offset == NULL) abort();
            for (int64_t i = 0; i < mc * K; i++) offset[i] = (int8_t)(xa[i] ^ 0x80);
        }
#pragma omp parallel
        {
            const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
            /* this thread's run: the blocks whose first byte lies in [t, t + 1) * total / nt */
            const int64_t lo = total * t / nt, hi = total * (t + 1) / nt;
            for (int64_t p = 0; p < nparts; p++) {
                const sd_part *w = &parts[p];
                const int64_t per = block_bytes(w, K), nb_count = first[p + 1] - first[p];
                /* blocks b of this part with bytes[p] + b * per in [lo, hi) */
                int64_t b0 = lo <= bytes[p] ? 0 : (lo - bytes[p] + per - 1) / per;
                int64_t b1 = hi <= bytes[p] ? 0 : (hi - bytes[p] + per - 1) / per;
                b1 = b1 < nb_count ? b1 : nb_count;
                const int8_t *xw = offset_q8(w->kind, path, amx) ? offset : xa;
                const float *bw = bias ? bias + first[p] * UNIT_ROWS : NULL;
                float *yw = y + m0 * ldy + first[p] * UNIT_ROWS;
                for (int64_t nb = b0; nb < b1; nb++) {
                    if (path == 0)
                        block_portable((int)w->kind, xw, xd + m0 * G, xs + m0 * G, mc, K, w->qs,
                                       w->d, w->mn, bw, nb, yw, ldy);
                    else
                        block_rows((int)w->kind, xw, xd + m0 * G, xs + m0 * G, mc, K, w->qs,
                                   w->d, w->mn, bw, nb, yw, ldy, amx);
                }
            }
        }
        free(offset);
        free(spread);
    }
}

/* One weight: N must be a multiple of 16 and K of 32 (the Python launcher pads and checks). */
void sd_q4_matmul(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K,
                  const uint8_t *qs, const uint16_t *d, const uint16_t *mn, const float *bias,
                  int64_t N, float *y, int64_t ldy, int path) {
    const sd_part w = {4, N, N, qs, d, mn};
    sd_parts_matmul(xq, xd, xs, M, K, &w, 1, bias, y, ldy, path);
}

void sd_q8_matmul(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K,
                  const int8_t *qs, const uint16_t *d, const uint16_t *mn, const float *bias,
                  int64_t N, float *y, int64_t ldy, int path) {
    const sd_part w = {8, N, N, qs, d, mn};
    sd_parts_matmul(xq, xd, xs, M, K, &w, 1, bias, y, ldy, path);
}

void sd_q5_matmul(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K,
                  const uint8_t *qs, const uint16_t *d, const uint16_t *mn, const float *bias,
                  int64_t N, float *y, int64_t ldy, int path) {
    const sd_part w = {5, N, N, qs, d, mn};
    sd_parts_matmul(xq, xd, xs, M, K, &w, 1, bias, y, ldy, path);
}

/* ---- attention over the paged KV cache ---------------------------------------------------------
 *
 * Row r attends to the first row_prefix[r] positions of its sequence (read through its block
 * table) and then to the cache slots extra_slots[extra_ptr[r] .. extra_ptr[r + 1]) in order (the
 * tree ancestors of a verification row, and the row itself). Every row is computed on its own, in
 * a fixed order of operations (the rows of a sequence share reads of its cache, never
 * arithmetic), so a row's result does not depend on which rows share its step: a verified draft
 * token gets bit for bit the attention it would get when decoded alone, which keeps greedy
 * speculative output equal to plain greedy output even where the weights and activations are
 * quantized (a last-bit difference could otherwise flip an int8 rounding).
 *
 * q [T, Hq, D], kc/vc [slots, Hkv, D] float32, out [T, Hq, D]; D a multiple of 16, Hq / Hkv <= 16.
 */
#define LANES 16

#define KV_AHEAD 16  /* values prefetched ahead of use (keys: the next run of 16, dots16) */

static inline void prefetch_row(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i);
}

/* q . k in a fixed order: 16 lanes, lane l summing elements l, l + 16, .. by fused multiply-adds,
 * then the lanes added pairwise (l + 8, l + 4, l + 2, l + 1), which is what
 * _mm512_reduce_add_ps does: both builds give the same bits. */
static inline float dot_fixed(const float *a, const float *b, int64_t D) {
#ifdef SD_AVX512
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
    for (int64_t d = LANES; d < D; d += LANES)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
    return _mm512_reduce_add_ps(acc);
#else
    float acc[LANES];
    for (int l = 0; l < LANES; l++) acc[l] = a[l] * b[l];
    for (int64_t d = LANES; d < D; d += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = fmaf(a[d + l], b[d + l], acc[l]);
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
#endif
}

/* s[t] = dot_fixed(a, keys[t], D) * scale for 16 keys. With AVX-512 the 16 horizontal sums are
 * done together, transposed: the same additions in the same pairs as _mm512_reduce_add_ps
 * (lanes l + 8, then l + 4, l + 2, l + 1), so the same bits, in 15 vector additions where one
 * key at a time took 4 extracts or shuffles and 4 additions each. */
static inline void dots16(const float *a, const float *const *keys, int64_t D, float scale,
                          float *s) {
#ifdef SD_AVX512
    __m512 v[16];
    const __m512 a0 = _mm512_loadu_ps(a);
    for (int t = 0; t < 16; t++) v[t] = _mm512_mul_ps(a0, _mm512_loadu_ps(keys[t]));
    for (int64_t d = LANES; d < D; d += LANES) {
        const __m512 ad = _mm512_loadu_ps(a + d);
        for (int t = 0; t < 16; t++) v[t] = _mm512_fmadd_ps(ad, _mm512_loadu_ps(keys[t] + d), v[t]);
    }
    __m512 b[8], c[4], e[2];
    for (int t = 0; t < 8; t++)  /* lanes l + 8: keys 2t, 2t + 1 in the two halves */
        b[t] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * t], v[2 * t + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * t], v[2 * t + 1], 0xEE));
    for (int t = 0; t < 4; t++)  /* l + 4: quarter Q holds key 4t + Q */
        c[t] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * t], b[2 * t + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * t], b[2 * t + 1], 0xDD));
    for (int t = 0; t < 2; t++)  /* l + 2 */
        e[t] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * t], c[2 * t + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(c[2 * t], c[2 * t + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* l + 1: lane 4 Q + m holds key Q + 4 m */
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(s, _mm512_mul_ps(_mm512_permutexvar_ps(order, r), _mm512_set1_ps(scale)));
#else
    for (int t = 0; t < 16; t++) s[t] = dot_fixed(a, keys[t], D) * scale;
#endif
}

/* s[0, S) <- softmax(s), in a fixed order: the maximum and the sum over 16 lanes (lane l takes
 * elements l, l + 16, ..), the lanes then combined pairwise as in dot_fixed. */
static void softmax_fixed(float *s, int64_t S) {
    float lane[LANES];
    for (int l = 0; l < LANES; l++) lane[l] = -INFINITY;
    int64_t i = 0;
    for (; i + LANES <= S; i += LANES)
        for (int l = 0; l < LANES; l++) lane[l] = s[i + l] > lane[l] ? s[i + l] : lane[l];
    for (int l = 0; i + l < S; l++) lane[l] = s[i + l] > lane[l] ? s[i + l] : lane[l];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) lane[l] = lane[l + w] > lane[l] ? lane[l + w] : lane[l];
    const float m = lane[0];
    for (int64_t k = 0; k < S; k++) s[k] = exp_nonpositive(s[k] - m);
    for (int l = 0; l < LANES; l++) lane[l] = 0.0f;
    for (i = 0; i + LANES <= S; i += LANES)
        for (int l = 0; l < LANES; l++) lane[l] += s[i + l];
    for (int l = 0; i + l < S; l++) lane[l] += s[i + l];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
    const float inv = 1.0f / lane[0];
    for (int64_t k = 0; k < S; k++) s[k] *= inv;
}

/* Attention's rows come in groups: consecutive rows of one sequence, at most GROUP_ROWS of them
 * (a verification's k + 1 rows, a chunk of a prefill). The rows of a group see the same leading
 * positions of their sequence (up to each one's own prefix), so each key and value there is
 * read from memory once for the whole group; read once a row, the cache cost a verified row of
 * the 1.5b target about as much as a plain step's attention, 2.2 ms at a 1,000-token context
 * (bench/investigations/cpu_attention_ab.py). Each row's scores, softmax and sums are computed
 * as they are for the row alone, in the same order. */
#define GROUP_ROWS 8
#define SUM_JOBS 6  /* (row, head) outputs summed in one pass over the values */
#define SUM_VECS 4  /* vectors of 16 of each output per pass */

/* One (row, head) output: o[d] = sum over its S positions i, in order, of p[i] * v_i[d], each
 * element a chain of fused multiply-adds, the first a plain product. Its positions: the
 * sequence's first np (shared slots), then its ne extra slots. */
typedef struct {
    float *p;  /* its scores, then probabilities (the task's scratch) */
    int64_t np, ne;
    const int64_t *extra;
    float *o;
} sum_job;

static inline const float *value_at(const sum_job *j, const int64_t *shared, int64_t i,
                                    const float *vc, int64_t stride) {
    return vc + (i < j->np ? shared[i] : j->extra[i - j->np]) * stride;
}

#ifdef SD_AVX512
/* Up to SUM_JOBS jobs over the columns [c0, c0 + 16 nv), their sums held in registers: one read
 * of each shared value serves every job. */
static void sum_pass(const sum_job *jobs, int nj, const int64_t *shared, const float *vc,
                     int64_t stride, int64_t c0, int nv) {
    __m512 acc[SUM_JOBS][SUM_VECS];
#pragma GCC unroll 6
    for (int b = 0; b < SUM_JOBS; b++)
#pragma GCC unroll 4
        for (int c = 0; c < SUM_VECS; c++) acc[b][c] = _mm512_setzero_ps();
    int64_t common = INT64_MAX, most = 0;
#pragma GCC unroll 6
    for (int b = 0; b < SUM_JOBS; b++) {
        if (b >= nj) break;
        const sum_job *j = &jobs[b];
        common = j->np < common ? j->np : common;
        most = j->np > most ? j->np : most;
        if (j->np + j->ne == 0) continue;
        const float *v = value_at(j, shared, 0, vc, stride) + c0;
        const __m512 p0 = _mm512_set1_ps(j->p[0]);
#pragma GCC unroll 4
        for (int c = 0; c < SUM_VECS; c++)
            if (c < nv) acc[b][c] = _mm512_mul_ps(p0, _mm512_loadu_ps(v + c * LANES));
    }
    /* positions every job sees as shared: no per-job test */
    for (int64_t i = 1; i < common; i++) {
        if (i + KV_AHEAD < most) prefetch_row(vc + shared[i + KV_AHEAD] * stride + c0, nv * LANES);
        const float *v = vc + shared[i] * stride + c0;
        __m512 x[SUM_VECS];
#pragma GCC unroll 4
        for (int c = 0; c < SUM_VECS; c++)
            x[c] = c < nv ? _mm512_loadu_ps(v + c * LANES) : _mm512_setzero_ps();
#pragma GCC unroll 6
        for (int b = 0; b < SUM_JOBS; b++) {
            if (b >= nj) break;
            const __m512 pi = _mm512_set1_ps(jobs[b].p[i]);
#pragma GCC unroll 4
            for (int c = 0; c < SUM_VECS; c++)
                if (c < nv) acc[b][c] = _mm512_fmadd_ps(pi, x[c], acc[b][c]);
        }
    }
    /* the rest of each job's positions: shared ones past `common`, then its extra slots */
#pragma GCC unroll 6
    for (int b = 0; b < SUM_JOBS; b++) {
        if (b >= nj) break;
        const sum_job *j = &jobs[b];
        const int64_t S = j->np + j->ne;
        for (int64_t i = common > 1 ? common : 1; i < S; i++) {
            const float *v = value_at(j, shared, i, vc, stride) + c0;
            const __m512 pi = _mm512_set1_ps(j->p[i]);
#pragma GCC unroll 4
            for (int c = 0; c < SUM_VECS; c++)
                if (c < nv) acc[b][c] = _mm512_fmadd_ps(pi, _mm512_loadu_ps(v + c * LANES),
                                                        acc[b][c]);
        }
#pragma GCC unroll 4
        for (int c = 0; c < SUM_VECS; c++)
            if (c < nv) _mm512_storeu_ps(j->o + c0 + c * LANES, acc[b][c]);
    }
}
#endif

static void weighted_sums(const sum_job *jobs, int64_t n, const int64_t *shared,
                          const float *vc, int64_t stride, int64_t D) {
#ifdef SD_AVX512
    for (int64_t c0 = 0; c0 < D; c0 += SUM_VECS * LANES) {
        const int nv = (int)((D - c0 < SUM_VECS * LANES ? D - c0 : SUM_VECS * LANES) / LANES);
        for (int64_t b = 0; b < n; b += SUM_JOBS)
            sum_pass(jobs + b, (int)(n - b < SUM_JOBS ? n - b : SUM_JOBS), shared, vc, stride,
                     c0, nv);
    }
#else
    for (int64_t b = 0; b < n; b++) {
        const sum_job *j = &jobs[b];
        const int64_t S = j->np + j->ne;
        for (int64_t d = 0; d < D; d++) j->o[d] = 0.0f;
        for (int64_t i = 0; i < S; i++) {
            const float *v = value_at(j, shared, i, vc, stride);
            const float pi = j->p[i];
            if (i == 0) {
                for (int64_t d = 0; d < D; d++) j->o[d] = pi * v[d];
            } else {
                for (int64_t d = 0; d < D; d++) j->o[d] = fmaf(pi, v[d], j->o[d]);
            }
        }
    }
#endif
}

void sd_attention(const float *q, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float *kc,
                  const float *vc, const int32_t *block_tables, int64_t bt_stride, int64_t bs,
                  const int32_t *row_seq, const int32_t *row_prefix, const int64_t *extra_ptr,
                  const int64_t *extra_slots, float scale, float *out) {
    const int64_t g = Hq / Hkv;
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(T + 1));  /* group starts */
    int64_t groups = 0;
    for (int64_t r = 0; r < T; r++)
        if (r == 0 || row_seq[r] != row_seq[r - 1] || r - first[groups - 1] == GROUP_ROWS)
            first[groups++] = r;
    first[groups] = T;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < groups * Hkv; task++) {
        const int64_t r0 = first[task / Hkv], R = first[task / Hkv + 1] - r0, h = task % Hkv;
        const int32_t *table = block_tables + (int64_t)row_seq[r0] * bt_stride;
        int64_t most = 0, scores = 0;
        for (int64_t r = r0; r < r0 + R; r++) {
            most = row_prefix[r] > most ? row_prefix[r] : most;
            scores += g * (row_prefix[r] + extra_ptr[r + 1] - extra_ptr[r]);
        }
        /* the cache slots of the sequence's first `most` positions; each row's scores, [g][S] */
        int64_t *shared = (int64_t *)malloc(sizeof(int64_t) * (size_t)(most > 0 ? most : 1));
        float *s = (float *)malloc(sizeof(float) * (size_t)(scores > 0 ? scores : 1));
        sum_job jobs[GROUP_ROWS * 16];
        for (int64_t b = 0, i = 0; i < most; b++) {
            const int64_t base = (int64_t)table[b] * bs;
            for (int64_t t = 0; t < bs && i < most; t++, i++) shared[i] = base + t;
        }
        float *sr = s;
        for (int64_t r = r0; r < r0 + R; r++) {
            const int64_t np = row_prefix[r], ne = extra_ptr[r + 1] - extra_ptr[r];
            for (int64_t j = 0; j < g; j++)
                jobs[(r - r0) * g + j] = (sum_job){sr + j * (np + ne), np, ne,
                                                   extra_slots + extra_ptr[r],
                                                   out + (r * Hq + h * g + j) * D};
            sr += g * (np + ne);
        }
        /* Keys sit in blocks scattered over the cache, mostly out of every cache level: each
         * run of 16 asks for the next 16 before it is used. */
        for (int64_t i = 0; i < most; i += 16) {
            const int64_t n = most - i < 16 ? most - i : 16;
            for (int64_t t = 0; i + 16 + t < most && t < 16; t++)
                prefetch_row(kc + (shared[i + 16 + t] * Hkv + h) * D, D);
            const float *kp[16];
            for (int64_t t = 0; t < n; t++) kp[t] = kc + (shared[i + t] * Hkv + h) * D;
            for (int64_t r = r0; r < r0 + R; r++) {
                const sum_job *row = &jobs[(r - r0) * g];
                const float *qh = q + (r * Hq + h * g) * D;
                const int64_t seen = row->np - i < n ? row->np - i : n;
                for (int64_t j = 0; j < g; j++) {
                    float *sj = row[j].p + i;
                    if (seen == 16)
                        dots16(qh + j * D, kp, D, scale, sj);
                    else
                        for (int64_t t = 0; t < seen; t++)
                            sj[t] = dot_fixed(qh + j * D, kp[t], D) * scale;
                }
            }
        }
        for (int64_t r = r0; r < r0 + R; r++) {
            const sum_job *row = &jobs[(r - r0) * g];
            const float *qh = q + (r * Hq + h * g) * D;
            for (int64_t e = 0; e < row->ne; e++) {
                const float *kp = kc + (row->extra[e] * Hkv + h) * D;
                for (int64_t j = 0; j < g; j++)
                    row[j].p[row->np + e] = dot_fixed(qh + j * D, kp, D) * scale;
            }
            for (int64_t j = 0; j < g; j++) softmax_fixed(row[j].p, row->np + row->ne);
        }
        weighted_sums(jobs, R * g, shared, vc + h * D, Hkv * D, D);
        free(s);
        free(shared);
    }
    free(first);
}
