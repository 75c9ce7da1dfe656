// Instruction-count harness for ggml's own AVX2 row dots (ggml-cpu/arch/x86/quants.c of the
// llama.cpp tree fourbit builds, compiled unchanged): one linear of N rows x K at batch 1,
// as llama.cpp's vec_dot path runs it, and its repacked 8-row GEMVs (arch/x86/repack.cpp,
// what llama.cpp's CPU backend uses for Q4_0 and Q4_K weights on AVX2 by default).
// benchmarks/int4_kernel.py --instructions builds it and counts run_<type> under
// callgrind, next to fourbit's kernel on the same shape.
//
//   harness q4_0|q4_1|q4_K|q4_0x8|q4_Kx8 N K
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define GGML_COMMON_DECL_C
#include "ggml-common.h"

void ggml_vec_dot_q4_0_q8_0(int n, float* s, size_t bs, const void* vx, size_t bx, const void* vy, size_t by, int nrc);
void ggml_vec_dot_q4_1_q8_1(int n, float* s, size_t bs, const void* vx, size_t bx, const void* vy, size_t by, int nrc);
void ggml_vec_dot_q4_K_q8_K(int n, float* s, size_t bs, const void* vx, size_t bx, const void* vy, size_t by, int nrc);
void ggml_gemv_q4_0_8x8_q8_0(int n, float* s, size_t bs, const void* vx, const void* vy, int nr, int nc);
void ggml_gemv_q4_K_8x8_q8_K(int n, float* s, size_t bs, const void* vx, const void* vy, int nr, int nc);
void quantize_row_q8_0(const float* x, void* vy, int64_t k);
void quantize_row_q8_1(const float* x, void* vy, int64_t k);
void quantize_row_q8_K(const float* x, void* vy, int64_t k);

static void fill(void* p, size_t bytes) {
  for (size_t i = 0; i < bytes; ++i) ((uint8_t*)p)[i] = (uint8_t)rand();
}

__attribute__((noinline)) void run_q4_0(int n, int k, const block_q4_0* w, const block_q8_0* y, float* out) {
  for (int r = 0; r < n; ++r) ggml_vec_dot_q4_0_q8_0(k, out + r, 0, w + (size_t)r * (k / 32), 0, y, 0, 1);
}
__attribute__((noinline)) void run_q4_1(int n, int k, const block_q4_1* w, const block_q8_1* y, float* out) {
  for (int r = 0; r < n; ++r) ggml_vec_dot_q4_1_q8_1(k, out + r, 0, w + (size_t)r * (k / 32), 0, y, 0, 1);
}
__attribute__((noinline)) void run_q4_K(int n, int k, const block_q4_K* w, const block_q8_K* y, float* out) {
  for (int r = 0; r < n; ++r) ggml_vec_dot_q4_K_q8_K(k, out + r, 0, w + (size_t)r * (k / 256), 0, y, 0, 1);
}

// The repacked layouts interleave 8 rows: block_q4_0x8 is 8 x (fp16 d + 16 bytes) per 32
// columns, block_q4_Kx8 8 x (fp16 d, fp16 dmin) + 96 scale bytes + 1024 code bytes per 256.
__attribute__((noinline)) void run_q4_0x8(int n, int k, const void* w, const block_q8_0* y, float* out) {
  ggml_gemv_q4_0_8x8_q8_0(k, out, n, w, y, 1, n);
}
__attribute__((noinline)) void run_q4_Kx8(int n, int k, const void* w, const block_q8_K* y, float* out) {
  ggml_gemv_q4_K_8x8_q8_K(k, out, n, w, y, 1, n);
}

int main(int argc, char** argv) {
  if (argc != 4) return 2;
  const int n = atoi(argv[2]), k = atoi(argv[3]);
  float* x = malloc(k * sizeof(float));
  for (int i = 0; i < k; ++i) x[i] = rand() / (float)RAND_MAX - 0.5f;
  float* out = malloc(n * sizeof(float));
  // Random bytes everywhere, fp16 scales included: the instruction count does not depend
  // on the values (no data-dependent branches in these loops).
  if (!strcmp(argv[1], "q4_0")) {
    block_q4_0* w = malloc((size_t)n * k / 32 * sizeof *w); fill(w, (size_t)n * k / 32 * sizeof *w);
    block_q8_0* y = malloc(k / 32 * sizeof *y); quantize_row_q8_0(x, y, k);
    run_q4_0(n, k, w, y, out);
  } else if (!strcmp(argv[1], "q4_1")) {
    block_q4_1* w = malloc((size_t)n * k / 32 * sizeof *w); fill(w, (size_t)n * k / 32 * sizeof *w);
    block_q8_1* y = malloc(k / 32 * sizeof *y); quantize_row_q8_1(x, y, k);
    run_q4_1(n, k, w, y, out);
  } else if (!strcmp(argv[1], "q4_K")) {
    block_q4_K* w = malloc((size_t)n * k / 256 * sizeof *w); fill(w, (size_t)n * k / 256 * sizeof *w);
    block_q8_K* y = malloc(k / 256 * sizeof *y); quantize_row_q8_K(x, y, k);
    run_q4_K(n, k, w, y, out);
  } else if (!strcmp(argv[1], "q4_0x8")) {
    const size_t bytes = (size_t)n / 8 * (k / 32) * (8 * sizeof(block_q4_0));
    void* w = malloc(bytes); fill(w, bytes);
    block_q8_0* y = malloc(k / 32 * sizeof *y); quantize_row_q8_0(x, y, k);
    run_q4_0x8(n, k, w, y, out);
  } else if (!strcmp(argv[1], "q4_Kx8")) {
    const size_t bytes = (size_t)n / 8 * (k / 256) * (16 + 16 + 96 + 1024);
    void* w = malloc(bytes); fill(w, bytes);
    block_q8_K* y = malloc(k / 256 * sizeof *y); quantize_row_q8_K(x, y, k);
    run_q4_Kx8(n, k, w, y, out);
  } else {
    return 2;
  }
  printf("%g\n", out[0]);
  return 0;
}
