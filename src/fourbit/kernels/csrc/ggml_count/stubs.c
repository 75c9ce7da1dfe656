// What quants.c needs from the rest of ggml, for the harness only: the fp16 table and
// Q8_K's reference quantizer (ggml-quants.c's definition: max |x| per 256, sums per 16).
#include <math.h>
#include <stdint.h>
#include <immintrin.h>
#define GGML_COMMON_DECL_C
#include "ggml-common.h"

float ggml_table_f32_f16[1 << 16];
float ggml_table_f32_e8m0_half[1 << 8];
float ggml_table_f32_ue4m3[1 << 8];

void quantize_row_q8_K_ref(const float* x, block_q8_K* y, int64_t k) {
  for (int64_t i = 0; i < k / 256; ++i, x += 256) {
    float amax = 0, mx = 0;
    for (int j = 0; j < 256; ++j) if (fabsf(x[j]) > amax) { amax = fabsf(x[j]); mx = x[j]; }
    const float is = amax ? -127.f / mx : 0.f;
    for (int j = 0; j < 256; ++j) { int v = (int)nearbyintf(is * x[j]); y[i].qs[j] = v > 127 ? 127 : v; }
    for (int j = 0; j < 16; ++j) {
      int s = 0;
      for (int l = 0; l < 16; ++l) s += y[i].qs[16 * j + l];
      y[i].bsums[j] = s;
    }
    y[i].d = is ? 1 / is : 0;
  }
}

__attribute__((constructor)) static void fill_table(void) {
  for (int i = 0; i < 1 << 16; ++i) ggml_table_f32_f16[i] = _cvtsh_ss((unsigned short)i);
}
