/* What layer_step.c calls in quant_matmul.c (see there for the layouts and the guarantees). */
#ifndef SD_QUANT_MATMUL_H
#define SD_QUANT_MATMUL_H

#include <stdint.h>

#define SD_MAX_PARTS 3

/* One quantized weight: n output rows (padded to 16; `rows` of them real) over k inputs. */
typedef struct {
    int64_t kind, n, rows;  /* kind 4, 5 or 8 (bits a value) */
    const void *qs;
    const uint16_t *d, *mn;  /* mn may be NULL */
} sd_part;

void sd_quantize_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd, float *xs);
void sd_parts_matmul(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K,
                     const sd_part *parts, int64_t nparts, const float *bias, float *y,
                     int64_t ldy, int path);
void sd_attention(const float *q, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float *kc,
                  const float *vc, const int32_t *block_tables, int64_t bt_stride, int64_t bs,
                  const int32_t *row_seq, const int32_t *row_prefix, const int64_t *extra_ptr,
                  const int64_t *extra_slots, float scale, float *out);

#endif
