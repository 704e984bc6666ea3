/* The decoder layers of a quantized model on the CPU, a whole run of them in one call.
 *
 * Each layer is the same computation as specdec/models/llama.py's DecoderLayer on QuantLinear
 * weights: rms norm, q/k/v (+ bias), optional per-head q/k norms, rotary, KV write, attention
 * over the paged cache, o projection, residual add, rms norm, gate/up, silu(gate) * up, down,
 * residual add. From Python each of these ops costs a dispatch (20-40 us a layer op on 2 cores,
 * which added up to half of a 0.5B draft model's decode step); here a layer costs its matmuls,
 * its attention and a few passes over its activations.
 *
 * Every op treats each row on its own in a fixed order (the matmuls and attention keep that
 * promise in quant_matmul.c), so a row's result does not depend on the rows beside it: a
 * verified draft token gets bit for bit what it gets decoded alone.
 *
 * Shapes: res [M, H] float32, updated in place; the caches [slots, Hkv, D]; cos and sin
 * [M, rot] (sin signed: rotate_half(x) * sin == roll(x, rot / 2) * signed sin). Scratch buffers
 * are the caller's (sd_scratch), sized for M rows.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fixed_math.h"
#include "quant_matmul.h"

/* A QuantLinear: parts side by side along the output, bias laid out like the padded output. */
typedef struct {
    int64_t nparts, k, width;  /* width: the padded output, the sum of the parts' n */
    sd_part parts[SD_MAX_PARTS];
    const float *bias;  /* [width] or NULL */
} sd_linear;

typedef struct {
    const float *in_norm, *post_norm;  /* [H] */
    const float *q_norm, *k_norm;      /* [D] or NULL (Qwen3) */
    sd_linear qkv, o, gate_up, down;
    float *kc, *vc;  /* this layer's caches, [slots, Hkv, D] */
} sd_layer;

/* What is the same for every layer of a step. */
typedef struct {
    int64_t M, H, Hq, Hkv, D, rot, inter;
    float eps, scale;
    int64_t path;  /* the matmul path for M rows (build.py's PATHS) */
    const float *cos, *sin;  /* [M, rot] */
    const int64_t *slots;    /* [M] cache slot of each row's new k and v */
    const int32_t *block_tables;
    int64_t bt_stride, block_size;
    const int32_t *row_seq, *row_prefix;  /* specdec/cpu_kernels/attention.py: RowsView */
    const int64_t *extra_ptr, *extra_slots;
    /* scratch */
    float *x;       /* [M, max(H, Hq D, inter)]: a normed or activated matmul input */
    float *wide;    /* [M, max(qkv width, gate_up width)] */
    float *attn;    /* [M, Hq D]: attention's output */
    float *narrow;  /* [M, max(o width, down width)] */
    int8_t *xq;     /* [M, max K] */
    float *xd, *xs; /* [M, max K / 32] */
} sd_step;

static void linear(const sd_linear *l, const sd_step *st, const float *x, float *y) {
    /* y [M, width] = x [M, k] @ W^T (+ bias) */
    sd_quantize_rows(x, st->M, l->k, st->xq, st->xd, st->xs);
    sd_parts_matmul(st->xq, st->xd, st->xs, st->M, l->k, l->parts, l->nparts, l->bias, y,
                    l->width, (int)st->path);
}

/* out[m] = x[m] / sqrt(mean(x[m]^2) + eps) * w, over n values per row (stride ld). */
static void rms_norm_rows(const float *x, int64_t M, int64_t n, int64_t ldx, const float *w,
                          float eps, float *out, int64_t ldo) {
#pragma omp parallel for schedule(static) if (M * n > (1 << 16))
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * ldx;
        double ss = 0.0;
        for (int64_t i = 0; i < n; i++) ss += (double)r[i] * r[i];
        const float inv = 1.0f / sqrtf((float)(ss / (double)n) + eps);
        float *o = out + m * ldo;
        for (int64_t i = 0; i < n; i++) o[i] = r[i] * inv * w[i];
    }
}

/* Rotate the first rot values of each head: x * cos + roll(x, rot / 2) * signed sin. */
static void rotate(float *head, const float *cos, const float *sin, int64_t rot) {
    float tmp[512];
    const int64_t half = rot / 2;
    for (int64_t i = 0; i < rot; i++) {
        const float rolled = i < half ? head[i + half] : head[i - half];
        tmp[i] = head[i] * cos[i] + rolled * sin[i];
    }
    memcpy(head, tmp, sizeof(float) * (size_t)rot);
}

static void attention_block(const sd_layer *L, const sd_step *st, float *res) {
    const int64_t M = st->M, H = st->H, D = st->D, Hq = st->Hq, Hkv = st->Hkv;
    const int64_t W = L->qkv.width;
    rms_norm_rows(res, M, H, H, L->in_norm, st->eps, st->x, H);
    linear(&L->qkv, st, st->x, st->wide);  /* [M, W]: q at 0, k at n_q, v at n_q + n_k */
    const int64_t k_at = L->qkv.parts[0].n;
    const int64_t v_at = k_at + (L->qkv.nparts > 1 ? L->qkv.parts[1].n : 0);
    for (int64_t m = 0; m < M; m++) {
        float *row = st->wide + m * W;
        const float *c = st->cos + m * st->rot, *s = st->sin + m * st->rot;
        for (int64_t h = 0; h < Hq + Hkv; h++) {
            float *head = h < Hq ? row + h * D : row + k_at + (h - Hq) * D;
            const float *nw = h < Hq ? L->q_norm : L->k_norm;
            if (nw) rms_norm_rows(head, 1, D, D, nw, st->eps, head, D);
            rotate(head, c, s, st->rot);
        }
        const int64_t slot = st->slots[m];
        memcpy(L->kc + slot * Hkv * D, row + k_at, sizeof(float) * (size_t)(Hkv * D));
        memcpy(L->vc + slot * Hkv * D, row + v_at, sizeof(float) * (size_t)(Hkv * D));
        /* the queries, packed [M, Hq, D] into x (free once the qkv matmul quantized it) */
        memcpy(st->x + m * Hq * D, row, sizeof(float) * (size_t)(Hq * D));
    }
    sd_attention(st->x, M, Hq, Hkv, D, L->kc, L->vc, st->block_tables, st->bt_stride,
                 st->block_size, st->row_seq, st->row_prefix, st->extra_ptr, st->extra_slots,
                 st->scale, st->attn);
    linear(&L->o, st, st->attn, st->narrow);
    const int64_t ow = L->o.width;
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < H; i++) res[m * H + i] += st->narrow[m * ow + i];
}

static void mlp_block(const sd_layer *L, const sd_step *st, float *res) {
    const int64_t M = st->M, H = st->H, I = st->inter, W = L->gate_up.width;
    const int64_t up_at = L->gate_up.parts[0].n;
    rms_norm_rows(res, M, H, H, L->post_norm, st->eps, st->x, H);
    linear(&L->gate_up, st, st->x, st->wide);  /* [M, W]: gate at 0, up at up_at */
#pragma omp parallel for schedule(static) if (M * I > (1 << 16))
    for (int64_t m = 0; m < M; m++) {
        const float *g = st->wide + m * W, *u = g + up_at;
        float *a = st->x + m * I;
        for (int64_t i = 0; i < I; i++) a[i] = silu_fixed(g[i]) * u[i];
    }
    linear(&L->down, st, st->x, st->narrow);
    const int64_t dw = L->down.width;
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < H; i++) res[m * H + i] += st->narrow[m * dw + i];
}

/* Layers [0, n) of `layers` over the residual stream res [M, H]. Returns 0, or -1 where a
 * shape is outside what this file handles (the caller checks first; this is a guard). */
int sd_layers(const sd_layer *layers, int64_t n, float *res, const sd_step *st) {
    if (st->rot > 512 || st->rot % 2 || st->rot > st->D) return -1;
    for (int64_t i = 0; i < n; i++) {
        attention_block(&layers[i], st, res);
        mlp_block(&layers[i], st, res);
    }
    return 0;
}
