// fourbit's CPU 4-bit linear: y[M, N] = x[M, K] @ W_hat[N, K]^T for small M (decode, batched decode).
//
// The layout and the numerics are described once, in src/fourbit/kernels/int4_cpu.py;
// this file follows it:
//
//   packed  uint8   [N, K/2]   per row, K in chunks of 64: byte i of chunk c holds
//                              k = 64c + i in its low nibble, k = 64c + 32 + i in its
//                              high one; a last half chunk (K % 64 == 32) holds
//                              k = 64C + i low, 64C + 16 + i high (i < 16)
//   scales  float32 [ceil(N/4), K/G, 4]   blocks of 4 rows (the rows computed together),
//   zeros   uint8   [ceil(N/4), K/G, 4]   padded with 0: W_hat[n, k] = s * (code[n, k] - z),
//                                         s, z at [n / 4, k / G, n % 4]
//
// A group's dot product is s * (sum q*x - z * sum x): the codes stay unsigned 0..15,
// which is what _mm256_maddubs_epi16 (unsigned x signed bytes) wants, and sum x is one
// number per group shared by every row.
//
//   W4A16  x in float32; q*x by FMA in float32, one accumulator per 8 columns.
//   W4A8   x rounded per 32-block to int8 (d = amax / 127, q = nearest-even(x * 127 / amax),
//          llama.cpp's Q8_0 with d kept in float32 rather than float16); sum q*qy per
//          block in integers (maddubs + madd: |q*qy| pair sums <= 2*15*127, no saturation),
//          then * d in float32; sum x is taken over the rounded activations, so the result
//          is W_hat @ x_rounded up to float summation order.
//   W4A8_GROUP  x rounded to int8 per weight group instead (d = amax / 127 over the G
//          columns of a group, as llama.cpp's Q8_K does per 256): a group's whole dot
//          product is one int32 sum, converted and scaled once (s * d) per row and group,
//          instead of once per 32 columns. At G = 32 it is W4A8.
//
// ISA, chosen at run time (__builtin_cpu_supports): AVX2+FMA for every numerics and group
// size; where AVX-512 VNNI (avx512f/bw/vl/vnni) is present, it for W4A16 at every G and
// for W4A8 and W4A8_GROUP at G = 128 * n. Without AVX2+FMA, isa() says "none" and the Python side falls back to
// tinygemm.
//
// Steps of several activation rows (from multirow_min()) run the kernels of multirow.inc,
// which unpack each weight once per pass of rows instead of once per row; the W4A8_GROUP
// one takes 8 activation rows a pass, one per int32 lane, and 4 output rows a call.
//
// Threads: at::parallel_for over blocks of output rows (torch's intra-op threads).

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <string>
#include <vector>

namespace {

constexpr int QK = 32;       // activation block (W4A8) and the K granularity of the layout
constexpr int CHUNK = 64;    // k per 32 packed bytes
constexpr int ROWS = 4;      // output rows computed together (shares activation loads)

enum Numerics : int64_t { W4A16 = 0, W4A8 = 1, W4A8_GROUP = 2 };

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool cpu_has_avx512_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

// The best path this CPU has: "avx512_vnni", "avx2" or "none". FOURBIT_INT4_ISA caps it:
// "avx2" runs the AVX2 code on an AVX-512 host (tests cover both paths on one machine),
// "none" hides the kernel (tests of the fallback). Read per call, so a test can switch it.
std::string isa() {
  const char* env = std::getenv("FOURBIT_INT4_ISA");
  const std::string cap = env ? env : "";
  if (cap == "none" || !cpu_has_avx2()) return "none";
  return cap == "avx2" || !cpu_has_avx512_vnni() ? "avx2" : "avx512_vnni";
}

// Rows from which a step runs the multi-row kernels (multirow.inc): 4, below which the
// one-row kernels, whose 4 output rows share each activation load, are as fast or faster
// (docs/engines.md has the measurements). FOURBIT_INT4_MULTIROW_MIN sets it, read per
// call, so a benchmark can time both kernels on one step in one process.
int64_t multirow_min() {
  const char* env = std::getenv("FOURBIT_INT4_MULTIROW_MIN");
  return env && *env ? std::max<int64_t>(2, std::atoll(env)) : 4;
}

// Whether a step of `rows` activation rows runs the multi-row kernels: W4A16 at every
// group size, W4A8_GROUP at groups of 64 * n (and W8A16, linear_int8).
bool multirow(int64_t numerics, int64_t g, int64_t rows) {
  return rows >= multirow_min() &&
         (numerics == W4A16 || (numerics == W4A8_GROUP && g % CHUNK == 0));
}

// The path one call runs: the multi-row kernels run on the host's ISA; one row runs
// AVX-512 for W4A16 at every group size and for the int8 numerics at groups of 128 * n.
std::string path(int64_t numerics, int64_t g, int64_t rows) {
  const std::string host = isa();
  if (multirow(numerics, g, rows)) return host;
  if (host == "avx512_vnni" && numerics != W4A16 && g % (2 * CHUNK) != 0) return "avx2";
  return host;
}

// ---- activations --------------------------------------------------------------------

void group_sums(const float* x, int64_t k, int64_t g, float* xsum) {
  for (int64_t gi = 0; gi < k / g; ++gi) {
    float s = 0.f;
    for (int64_t i = 0; i < g; ++i) s += x[gi * g + i];
    xsum[gi] = s;
  }
}

// ---- AVX2 ---------------------------------------------------------------------------

#define FOURBIT_AVX2 __attribute__((target("avx2,fma")))

FOURBIT_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Calls groups(std::integral_constant<int, CPG>{}) for G = 64 * CPG: CPG = 1 and 2 give
// the group functions below a fixed, unrolled chunk count; 0 any other multiple of 64
// (they then loop over the g / CHUNK chunks they are given).
// Both it and the lambdas passed to it are always inlined: left as calls they add
// instructions per weight (docs/engines.md has the measurements).
template <typename Groups>
FOURBIT_AVX2 __attribute__((always_inline)) inline void by_group_size(int64_t g, Groups&& groups) {
  if (g == CHUNK) {
    groups(std::integral_constant<int, 1>{});
  } else if (g == 2 * CHUNK) {
    groups(std::integral_constant<int, 2>{});
  } else {
    groups(std::integral_constant<int, 0>{});
  }
}

// out[r] = the sum of row r's accumulator minus its zero-point term (lane r of corr).
FOURBIT_AVX2 inline void finish_rows(const __m256* acc, __m128 corr, float* out) {
  float c4[4];
  _mm_storeu_ps(c4, corr);
  for (int r = 0; r < ROWS; ++r) out[r] = hsum8(acc[r]) - c4[r];
}

// Sum over the 32 unsigned codes in `w` (32 bytes, one code each) times the 32 int8
// activations at `y`, as 8 int32 partial sums converted to float.
FOURBIT_AVX2 inline __m256 block_dot_i8(__m256i w, const int8_t* y) {
  const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y));
  const __m256i pairs = _mm256_maddubs_epi16(w, qy);  // 16 x int16, |.| <= 3810
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// One row's packed chunk (32 bytes: 64 codes) against the chunk's two int8 activation
// blocks: p0 = low nibbles x y0, p1 = high nibbles x y1, 16 int16 pair sums each.
FOURBIT_AVX2 inline void chunk_products(const uint8_t* bytes, __m256i y0, __m256i y1,
                                        __m256i& p0, __m256i& p1) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  p0 = _mm256_maddubs_epi16(_mm256_and_si256(raw, low), y0);
  p1 = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), y1);
}

// The zero-point term of ROWS rows at group gi, s * z * sum(x), added to corr (one lane
// per row): the scales and zeros of a row block are stored [K/G][ROWS], so it is one
// vector operation for the block.
FOURBIT_AVX2 inline __m128 add_zero_term(__m128 corr, const float* sb, const uint8_t* zb,
                                         int64_t gi, float xsum) {
  int32_t z4;
  std::memcpy(&z4, zb + gi * ROWS, sizeof z4);
  const __m128 z = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(z4)));
  const __m128 sz = _mm_mul_ps(_mm_loadu_ps(sb + gi * ROWS), z);
  return _mm_fmadd_ps(sz, _mm_set1_ps(xsum), corr);
}

// W4A8 for G = 64 * CPG (CPG = 0: any multiple of 64, given as `chunks`): a group's
// block sums are scaled by the blocks' d into one partial per row, which is scaled by s
// once. A fixed CPG unrolls the group: no inner loop to set up per group, nor the
// register spills that set-up causes.
template <int CPG>
FOURBIT_AVX2 inline void groups_w4a8(const uint8_t* const* w, const float* sb, const uint8_t* zb,
                                     const int8_t* qy, const float* d, const float* xsum,
                                     int64_t groups, __m256* acc, __m128& corr,
                                     int64_t chunks = CPG) {
  constexpr int R = ROWS;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m256 part[R];
    for (int r = 0; r < R; ++r) part[r] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int64_t j = 0; j < (CPG ? CPG : chunks); ++j) {
      const int64_t c = gi * (CPG ? CPG : chunks) + j;
      const __m256 d0 = _mm256_broadcast_ss(d + 2 * c);
      const __m256 d1 = _mm256_broadcast_ss(d + 2 * c + 1);
      const __m256i y0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qy + c * CHUNK));
      const __m256i y1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qy + c * CHUNK + QK));
      for (int r = 0; r < R; ++r) {
        __m256i p0, p1;
        chunk_products(w[r] + c * 32, y0, y1, p0, p1);
        part[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p0, ones)), d0, part[r]);
        part[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p1, ones)), d1, part[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(part[r], _mm256_broadcast_ss(sb + gi * R + r), acc[r]);
    }
    corr = add_zero_term(corr, sb, zb, gi, xsum[gi]);
  }
}

// x [K] float32 -> qy [K] int8, d [K/block], and per group the sum of the rounded values
// d * sum(qy) ([K/G]), and where asked sum(qy) per block ([K/block], W8A8's correction);
// block is 32 (W4A8) or G (W4A8_GROUP, W8A8), g a multiple of block:
// q = round-half-even(x * (127 / amax)) in float32 over each block, as ggml's
// quantize_row_q8_0 computes it. Vectorized because it runs on one thread before the rows
// are split over threads.
FOURBIT_AVX2 void quantize_q8_avx2(const float* x, int64_t k, int64_t block, int64_t g,
                                   int8_t* qy, float* d, float* xsum, float* qsum = nullptr) {
  const int64_t per_group = g / block;
  for (int64_t gi = 0; gi < k / g; ++gi) xsum[gi] = 0.f;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < k / block; ++b) {
    const float* xb = x + b * block;
    __m256 amax = _mm256_setzero_ps();
    for (int64_t j = 0; j < block; j += 8) {
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + j)));
    }
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float top = _mm_cvtss_f32(m4);
    const __m256 inv = _mm256_set1_ps(top != 0.f ? 127.f / top : 0.f);
    d[b] = top / 127.f;
    __m256i total = _mm256_setzero_si256();
    for (int64_t j = 0; j < block; j += QK) {  // 32 values at a time: 4 x 8 -> 32 int8
      __m256i q[4];
      for (int v = 0; v < 4; ++v) {
        q[v] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 8 * v), inv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      }
      total = _mm256_add_epi32(total, _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                                       _mm256_add_epi32(q[2], q[3])));
      // int32 -> int16 -> int8 packs work per 128-bit lane; the permute restores k order
      const __m256i p16a = _mm256_packs_epi32(q[0], q[1]);
      const __m256i p16b = _mm256_packs_epi32(q[2], q[3]);
      const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qy + b * block + j), p8);
    }
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 1));
    xsum[b / per_group] += d[b] * static_cast<float>(_mm_cvtsi128_si32(t));
    if (qsum) qsum[b] = static_cast<float>(_mm_cvtsi128_si32(t));  // exact: |t| <= 127 * block
  }
}

// W4A8_GROUP for G = 64 * CPG (CPG = 0: any multiple of 64, given as `chunks`): one d
// per group, so a row's products are summed in int32 over the whole group (maddubs, then
// madd to int32 per chunk: no int16 sum grows past 2 * 15 * 127) and converted and scaled
// by s * d once per group.
template <int CPG>
FOURBIT_AVX2 inline void groups_w4a8_group(const uint8_t* const* w, const float* sb,
                                           const uint8_t* zb, const int8_t* qy, const float* d,
                                           const float* xsum, int64_t groups, __m256* acc,
                                           __m128& corr, int64_t chunks = CPG) {
  constexpr int R = ROWS;
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t per = CPG ? CPG : chunks;
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m256i sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int64_t j = 0; j < per; ++j) {
      const int64_t c = gi * per + j;
      const __m256i y0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qy + c * CHUNK));
      const __m256i y1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qy + c * CHUNK + QK));
      for (int r = 0; r < R; ++r) {
        __m256i p0, p1;
        chunk_products(w[r] + c * 32, y0, y1, p0, p1);
        sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones));
      }
    }
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_set1_ps(sb[gi * R + r] * d[gi]),
                               acc[r]);
    }
    corr = add_zero_term(corr, sb, zb, gi, xsum[gi]);
  }
}

// ROWS rows of W4A8. w[r] points at row r's packed bytes; sb / zb at the row block's
// scales / zeros, [K/G][ROWS] each.
FOURBIT_AVX2 void rows_w4a8(const uint8_t* const* w, const float* sb, const uint8_t* zb,
                            const int8_t* qy, const float* d, const float* xsum, int64_t k,
                            int64_t g, float* out) {
  constexpr int R = ROWS;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int64_t full = k / CHUNK;
  const int64_t groups = k / g;
  __m256 acc[R];
  __m128 corr = _mm_setzero_ps();
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  if (g == QK) {
    // One block per group: the combined scale s * d multiplies each block's sum.
    for (int64_t c = 0; c < full; ++c) {
      const float d0 = d[2 * c], d1 = d[2 * c + 1];
      const int8_t* y = qy + c * CHUNK;
      const float* s0 = sb + 2 * c * R;
      for (int r = 0; r < R; ++r) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + c * 32));
        const __m256 p0 = block_dot_i8(_mm256_and_si256(raw, low), y);
        const __m256 p1 = block_dot_i8(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), y + QK);
        acc[r] = _mm256_fmadd_ps(p0, _mm256_set1_ps(s0[r] * d0), acc[r]);
        acc[r] = _mm256_fmadd_ps(p1, _mm256_set1_ps(s0[R + r] * d1), acc[r]);
      }
    }
    if (k % CHUNK) {  // the half chunk: 16 bytes, k = 64C + i low, 64C + 16 + i high
      const int64_t b = 2 * full;
      for (int r = 0; r < R; ++r) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[r] + full * 32));
        const __m256i codes = _mm256_and_si256(
            _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);  // [lo 16 | hi 16] = k order
        const __m256 p = block_dot_i8(codes, qy + b * QK);
        acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(sb[b * R + r] * d[b]), acc[r]);
      }
    }
    for (int64_t gi = 0; gi < groups; ++gi) corr = add_zero_term(corr, sb, zb, gi, xsum[gi]);
  } else {
    by_group_size(g, [&](auto cpg) FOURBIT_AVX2 __attribute__((always_inline)) {
      groups_w4a8<decltype(cpg)::value>(w, sb, zb, qy, d, xsum, groups, acc, corr, g / CHUNK);
    });
  }
  finish_rows(acc, corr, out);
}

// ROWS rows of W4A8_GROUP (d per group); at G = 32 the group is the block: W4A8's code.
FOURBIT_AVX2 void rows_w4a8_group(const uint8_t* const* w, const float* sb, const uint8_t* zb,
                                  const int8_t* qy, const float* d, const float* xsum,
                                  int64_t k, int64_t g, float* out) {
  if (g == QK) {
    rows_w4a8(w, sb, zb, qy, d, xsum, k, g, out);
    return;
  }
  constexpr int R = ROWS;
  __m256 acc[R];
  __m128 corr = _mm_setzero_ps();
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t groups = k / g;
  by_group_size(g, [&](auto cpg) FOURBIT_AVX2 __attribute__((always_inline)) {
    groups_w4a8_group<decltype(cpg)::value>(w, sb, zb, qy, d, xsum, groups, acc, corr, g / CHUNK);
  });
  finish_rows(acc, corr, out);
}

// ---- AVX-512 VNNI: W4A8 and W4A8_GROUP at G = 128 * n -----------------------------
//
// vpdpbusd adds four unsigned-code x signed-activation products into each int32 lane in one
// instruction, where AVX2 takes maddubs + madd (+ add), and one 64-byte load holds two
// chunks (128 codes) of a row, so a group of 128 is one load per row. Lane j of each
// 32-byte half sums bytes 4j..4j+3 on both paths: the integer sums are AVX2's lane for
// lane and only the float accumulation order differs.

#define FOURBIT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))

// GCC 12's AVX-512 headers seed intrinsics with self-initialized "undefined" vectors and
// then warn about them under -O3 (GCC bug 105593, fixed in 13); the warnings are theirs.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// The activations a row's 64-byte load at chunk c meets: its low nibbles are k = 64c + i
// and 64c + 64 + i (i < 32), its high ones 64c + 32 + i and 64c + 96 + i.
FOURBIT_AVX512 inline void pair_activations(const int8_t* y, __m512i& lo, __m512i& hi) {
  const __m256i* v = reinterpret_cast<const __m256i*>(y);  // four 32-byte blocks
  lo = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(v)), _mm256_loadu_si256(v + 2), 1);
  hi = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(v + 1)), _mm256_loadu_si256(v + 3), 1);
}

// One row's two chunks (64 bytes) against pair_activations' lo / hi: the low and the high
// nibbles' products, each summed four at a time into 16 int32 lanes on top of p_lo / p_hi.
FOURBIT_AVX512 inline void pair_products(const uint8_t* bytes, __m512i lo, __m512i hi,
                                         __m512i& p_lo, __m512i& p_hi) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i raw = _mm512_loadu_si512(bytes);
  p_lo = _mm512_dpbusd_epi32(p_lo, _mm512_and_si512(raw, low), lo);
  p_hi = _mm512_dpbusd_epi32(p_hi, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low), hi);
}

FOURBIT_AVX512 inline void finish_rows_512(const __m512* acc, __m128 corr, float* out) {
  float c4[4];
  _mm_storeu_ps(c4, corr);
  for (int r = 0; r < ROWS; ++r) out[r] = _mm512_reduce_add_ps(acc[r]) - c4[r];
}

// W4A8_GROUP (PER_GROUP) or W4A8 for G = 128 * PPG (PPG = 0: any multiple of 128, given
// as `pairs`). W4A8_GROUP has one d per group: a row's products are one int32 sum per group
// (no lane exceeds 8 * 15 * 127 per pair), converted and scaled by s * d once. W4A8 scales
// each 32-block's sums by its d (a pair of chunks holds blocks 2c..2c+3: lanes 0-7 of the
// low products are block 2c, lanes 8-15 block 2c + 2), then the group's partial by s.
template <int PPG, bool PER_GROUP>
FOURBIT_AVX512 inline void groups_int8_512(const uint8_t* const* w, const float* sb,
                                           const uint8_t* zb, const int8_t* qy, const float* d,
                                           const float* xsum, int64_t groups, __m512* acc,
                                           __m128& corr, int64_t pairs = PPG) {
  constexpr int R = ROWS;
  const int64_t per = PPG ? PPG : pairs;
  const __m512i lo_blocks = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i hi_blocks = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1);
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m512i sum[R];  // W4A8_GROUP
    __m512 part[R];  // W4A8
    for (int r = 0; r < R; ++r) {
      sum[r] = _mm512_setzero_si512();
      part[r] = _mm512_setzero_ps();
    }
#pragma GCC unroll 2
    for (int64_t j = 0; j < per; ++j) {
      const int64_t c = 2 * (gi * per + j);
      __m512i lo, hi;
      pair_activations(qy + c * CHUNK, lo, hi);
      if constexpr (PER_GROUP) {
        for (int r = 0; r < R; ++r) pair_products(w[r] + c * 32, lo, hi, sum[r], sum[r]);
      } else {
        const __m512 d4 = _mm512_castps128_ps512(_mm_loadu_ps(d + 2 * c));  // blocks 2c..2c+3
        const __m512 d_lo = _mm512_permutexvar_ps(lo_blocks, d4);
        const __m512 d_hi = _mm512_permutexvar_ps(hi_blocks, d4);
        for (int r = 0; r < R; ++r) {
          __m512i p_lo = _mm512_setzero_si512(), p_hi = _mm512_setzero_si512();
          pair_products(w[r] + c * 32, lo, hi, p_lo, p_hi);
          part[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p_lo), d_lo, part[r]);
          part[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p_hi), d_hi, part[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      if constexpr (PER_GROUP) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]),
                                 _mm512_set1_ps(sb[gi * R + r] * d[gi]), acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(part[r], _mm512_set1_ps(sb[gi * R + r]), acc[r]);
      }
    }
    corr = add_zero_term(corr, sb, zb, gi, xsum[gi]);
  }
}

// ROWS rows of W4A8 (per_group_d false) or W4A8_GROUP (true) at G = 128 * n; arguments as
// for rows_w4a8 / rows_w4a8_group.
FOURBIT_AVX512 void rows_int8_512(bool per_group_d, const uint8_t* const* w, const float* sb,
                                  const uint8_t* zb, const int8_t* qy, const float* d,
                                  const float* xsum, int64_t k, int64_t g, float* out) {
  __m512 acc[ROWS];
  __m128 corr = _mm_setzero_ps();
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t groups = k / g, pairs = g / (2 * CHUNK);
  if (per_group_d && pairs == 1) {
    groups_int8_512<1, true>(w, sb, zb, qy, d, xsum, groups, acc, corr);
  } else if (per_group_d) {
    groups_int8_512<0, true>(w, sb, zb, qy, d, xsum, groups, acc, corr, pairs);
  } else if (pairs == 1) {
    groups_int8_512<1, false>(w, sb, zb, qy, d, xsum, groups, acc, corr);
  } else {
    groups_int8_512<0, false>(w, sb, zb, qy, d, xsum, groups, acc, corr, pairs);
  }
  finish_rows_512(acc, corr, out);
}

// ---- AVX-512: W4A16 at every group size -----------------------------------------
//
// The AVX2 W4A16 code's structure at twice its width: a 16-byte load widened to 16 int32
// lanes holds 16 columns of a row's low nibbles and 16 of its high ones, so each convert
// and FMA covers 16 weights instead of 8. Same sums per group, same zero-point term; only
// the float summation order differs from the AVX2 path.

// As span_w4a16 (below): `bytes` (a multiple of 16) packed bytes of R rows from byte0.
template <int R>
FOURBIT_AVX512 inline void span_w4a16_512(const uint8_t* const* w, const float* x, int64_t byte0,
                                          int64_t k_lo, int64_t k_hi, int64_t bytes,
                                          __m512* lo_acc, __m512* hi_acc) {
  const __m512i low = _mm512_set1_epi32(0x0F);
  for (int64_t i = 0; i < bytes; i += 16) {
    const __m512 x_lo = _mm512_loadu_ps(x + k_lo + i);
    const __m512 x_hi = _mm512_loadu_ps(x + k_hi + i);
    for (int r = 0; r < R; ++r) {
      const __m512i b = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[r] + byte0 + i)));  // 16 x int32
      lo_acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, low)), x_lo, lo_acc[r]);
      hi_acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), x_hi, hi_acc[r]);
    }
  }
}

// acc[r] += s[r] * (lo_acc[r] + hi_acc[r]): one group's float sums scaled by its scales.
FOURBIT_AVX512 inline void scale_group_512(const __m512* lo_acc, const __m512* hi_acc,
                                           const float* s, __m512* acc) {
  for (int r = 0; r < ROWS; ++r) {
    acc[r] = _mm512_fmadd_ps(_mm512_add_ps(lo_acc[r], hi_acc[r]), _mm512_set1_ps(s[r]), acc[r]);
  }
}

// ROWS rows of W4A16 on AVX-512; arguments as for rows_w4a16. G = 32 reads a chunk once for
// its two groups (low nibbles group 2c, high ones 2c + 1), as the AVX2 code does.
FOURBIT_AVX512 void rows_w4a16_512(const uint8_t* const* w, const float* sb, const uint8_t* zb,
                                   const float* x, const float* xsum, int64_t k, int64_t g,
                                   float* out) {
  constexpr int R = ROWS;
  const __m512 zero = _mm512_setzero_ps();
  __m512 acc[R], lo_acc[R], hi_acc[R];
  __m128 corr = _mm_setzero_ps();
  for (int r = 0; r < R; ++r) acc[r] = zero;
  const int64_t full = k / CHUNK;
  if (g == QK) {
    for (int64_t c = 0; c < full; ++c) {
      for (int r = 0; r < R; ++r) lo_acc[r] = hi_acc[r] = zero;
      span_w4a16_512<R>(w, x, c * 32, c * CHUNK, c * CHUNK + QK, 32, lo_acc, hi_acc);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_fmadd_ps(lo_acc[r], _mm512_set1_ps(sb[2 * c * R + r]), acc[r]);
        acc[r] = _mm512_fmadd_ps(hi_acc[r], _mm512_set1_ps(sb[(2 * c + 1) * R + r]), acc[r]);
      }
      corr = add_zero_term(corr, sb, zb, 2 * c, xsum[2 * c]);
      corr = add_zero_term(corr, sb, zb, 2 * c + 1, xsum[2 * c + 1]);
    }
    if (k % CHUNK) {  // the half chunk is one group: k 0..15 low, 16..31 high
      for (int r = 0; r < R; ++r) lo_acc[r] = hi_acc[r] = zero;
      span_w4a16_512<R>(w, x, full * 32, full * CHUNK, full * CHUNK + 16, 16, lo_acc, hi_acc);
      scale_group_512(lo_acc, hi_acc, sb + 2 * full * R, acc);
      corr = add_zero_term(corr, sb, zb, 2 * full, xsum[2 * full]);
    }
  } else {
    const int64_t per = g / CHUNK;
    for (int64_t gi = 0; gi < k / g; ++gi) {
      for (int r = 0; r < R; ++r) lo_acc[r] = hi_acc[r] = zero;
      for (int64_t c = gi * per; c < (gi + 1) * per; ++c) {
        span_w4a16_512<R>(w, x, c * 32, c * CHUNK, c * CHUNK + QK, 32, lo_acc, hi_acc);
      }
      scale_group_512(lo_acc, hi_acc, sb + gi * R, acc);
      corr = add_zero_term(corr, sb, zb, gi, xsum[gi]);
    }
  }
  finish_rows_512(acc, corr, out);
}

#pragma GCC diagnostic pop

// `bytes` packed bytes of R rows from byte0: low nibbles times x[k_lo + i], high ones
// times x[k_hi + i], added to lo_acc / hi_acc.
template <int R>
FOURBIT_AVX2 inline void span_w4a16(const uint8_t* const* w, const float* x, int64_t byte0,
                                    int64_t k_lo, int64_t k_hi, int64_t bytes, __m256* lo_acc,
                                    __m256* hi_acc) {
  const __m256i low = _mm256_set1_epi32(0x0F);
  for (int64_t i = 0; i < bytes; i += 8) {
    const __m256 x_lo = _mm256_loadu_ps(x + k_lo + i);
    const __m256 x_hi = _mm256_loadu_ps(x + k_hi + i);
    for (int r = 0; r < R; ++r) {
      const __m256i b = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w[r] + byte0 + i)));  // 8 x int32
      lo_acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, low)), x_lo, lo_acc[r]);
      hi_acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), x_hi, hi_acc[r]);
    }
  }
}

// W4A16 for G = 64 * CPG (CPG = 0: any multiple of 64, given as `chunks`), one group at
// a time with two accumulators per row (low and high nibbles), so consecutive FMAs of a
// row do not wait on each other; a fixed CPG unrolls the group (no loop set-up per group).
template <int CPG>
FOURBIT_AVX2 inline void groups_w4a16(const uint8_t* const* w, const float* sb,
                                      const uint8_t* zb, const float* x, const float* xsum,
                                      int64_t groups, __m256* acc, __m128& corr,
                                      int64_t chunks = CPG) {
  constexpr int R = ROWS;
  const int64_t per = CPG ? CPG : chunks;
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m256 lo_acc[R], hi_acc[R];
    for (int r = 0; r < R; ++r) lo_acc[r] = hi_acc[r] = _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int64_t j = 0; j < per; ++j) {
      const int64_t c = gi * per + j;
      span_w4a16<R>(w, x, c * 32, c * CHUNK, c * CHUNK + QK, 32, lo_acc, hi_acc);
    }
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_add_ps(lo_acc[r], hi_acc[r]),
                               _mm256_broadcast_ss(sb + gi * R + r), acc[r]);
    }
    corr = add_zero_term(corr, sb, zb, gi, xsum[gi]);
  }
}

// ROWS rows of W4A16 (float32 activations x [K]); sb / zb as for rows_w4a8.
FOURBIT_AVX2 void rows_w4a16(const uint8_t* const* w, const float* sb, const uint8_t* zb,
                             const float* x, const float* xsum, int64_t k, int64_t g,
                             float* out) {
  constexpr int R = ROWS;
  __m256 acc[R];
  __m128 corr = _mm_setzero_ps();
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t groups = k / g;
  const int64_t full = k / CHUNK;
  if (g == QK) {
    // G = 32: a chunk's low nibbles are group 2c, its high ones group 2c + 1, so one pass
    // over the chunk's bytes fills both groups' accumulators, instead of reading the bytes
    // once per group. The half chunk (K % 64) is one group: k 0..15 low, 16..31 high.
    for (int64_t c = 0; c < full; ++c) {
      __m256 lo_acc[R], hi_acc[R];
      for (int r = 0; r < R; ++r) lo_acc[r] = hi_acc[r] = _mm256_setzero_ps();
      span_w4a16<R>(w, x, c * 32, c * CHUNK, c * CHUNK + QK, 32, lo_acc, hi_acc);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_fmadd_ps(lo_acc[r], _mm256_broadcast_ss(sb + 2 * c * R + r), acc[r]);
        acc[r] = _mm256_fmadd_ps(hi_acc[r], _mm256_broadcast_ss(sb + (2 * c + 1) * R + r), acc[r]);
      }
      corr = add_zero_term(corr, sb, zb, 2 * c, xsum[2 * c]);
      corr = add_zero_term(corr, sb, zb, 2 * c + 1, xsum[2 * c + 1]);
    }
    if (k % CHUNK) {
      const int64_t gi = 2 * full;
      __m256 lo_acc[R], hi_acc[R];
      for (int r = 0; r < R; ++r) lo_acc[r] = hi_acc[r] = _mm256_setzero_ps();
      span_w4a16<R>(w, x, full * 32, full * CHUNK, full * CHUNK + 16, 16, lo_acc, hi_acc);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_fmadd_ps(_mm256_add_ps(lo_acc[r], hi_acc[r]),
                                 _mm256_broadcast_ss(sb + gi * R + r), acc[r]);
      }
      corr = add_zero_term(corr, sb, zb, gi, xsum[gi]);
    }
  } else {
    by_group_size(g, [&](auto cpg) FOURBIT_AVX2 __attribute__((always_inline)) {
      groups_w4a16<decltype(cpg)::value>(w, sb, zb, x, xsum, groups, acc, corr, g / CHUNK);
    });
  }
  finish_rows(acc, corr, out);
}

// ---- 8-bit weights: W8A16 --------------------------------------------------------------
//
//   codes   int8    [N, K]     W_hat[n, k] = codes[n, k] * scales[n, k / G]
//   scales  float32 [N, K/G]   (fourbit.formats.int8 as stored, scales widened at load)
//
// x in float32; 8 codes at a time sign-extended to int32, converted and multiplied by FMA,
// two accumulators per row so consecutive FMAs do not wait on each other; each group's
// sum scaled once per row. G any multiple of 16.

FOURBIT_AVX2 inline __m256 codes8_ps(const int8_t* c) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))));
}

FOURBIT_AVX2 void rows_w8a16(const int8_t* const* w, const float* const* s, const float* x,
                             int64_t k, int64_t g, float* out) {
  constexpr int R = ROWS;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t gi = 0; gi < k / g; ++gi) {
    __m256 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
    for (int64_t i = gi * g; i < (gi + 1) * g; i += 16) {
      const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
      for (int r = 0; r < R; ++r) {
        a0[r] = _mm256_fmadd_ps(codes8_ps(w[r] + i), x0, a0[r]);
        a1[r] = _mm256_fmadd_ps(codes8_ps(w[r] + i + 8), x1, a1[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_add_ps(a0[r], a1[r]), _mm256_broadcast_ss(s[r] + gi), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]);
}

// Bytes of weights requested ahead of the row block being computed. A row block is a few
// short streams that restart at each 4 KiB page; the hardware prefetchers alone then keep
// a 4-bit kernel far below the bandwidth float32 sgemv reaches. Any distance from 2 to
// 8 KiB does as well as 4 (docs/engines.md has the measurements).
constexpr int64_t PREFETCH_AHEAD = 4096;

// Row block b's weights (`block_bytes` each from `weights`), requested PREFETCH_AHEAD past
// its start, before the block is computed (a prefetch past the tensor's end is harmless:
// it never faults). Always inlined: without that, GCC left no prefetch instruction in the
// multi-row kernels (compiled for AVX2 or AVX-512 while this is not), which cost W8A8 2.6x
// at the head's shape (docs/engines.md).
__attribute__((always_inline)) inline void prefetch_block(const void* weights, int64_t block_bytes, int64_t b) {
  const char* next = static_cast<const char*>(weights) + PREFETCH_AHEAD + b * block_bytes;
  for (int64_t j = 0; j < block_bytes; j += 64) _mm_prefetch(next + j, _MM_HINT_T0);
}

// The blocks of ROWS output rows of N over torch's threads, each thread's range to
// `blocks(b0, b1)`: enough blocks per task that a task is not dominated by its start-up;
// small layers (k_proj's 128 rows) still split in two.
template <typename Blocks>
void over_blocks(int64_t n, Blocks&& blocks) {
  const int64_t count = (n + ROWS - 1) / ROWS;
  at::parallel_for(0, count, std::max<int64_t>(1, std::min<int64_t>(64, count / 8)), blocks);
}

// One activation row at a time: each block's rows (a short last block repeating its last
// row) handed to `rows(block start, rows, x row, out)`.
template <typename Rows>
void over_row_blocks(int64_t m, int64_t n, float* yp, const void* weights, int64_t block_bytes,
                     Rows&& rows) {
  over_blocks(n, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * ROWS;
      const int count = static_cast<int>(std::min<int64_t>(ROWS, n - r0));
      int64_t row[ROWS];
      for (int r = 0; r < ROWS; ++r) row[r] = r0 + std::min(r, count - 1);
      prefetch_block(weights, block_bytes, b);
      for (int64_t i = 0; i < m; ++i) {
        float out[ROWS];
        rows(b, row, i, out);
        std::memcpy(yp + i * n + r0, out, count * sizeof(float));
      }
    }
  });
}

// Columns a multi-row kernel covers at a time: a pass's activations for them (8 rows x 512
// float32 = 16 KiB) stay in L1 while the block's 4 output rows use them, where whole rows
// of down_proj's K = 4864 would be 155 KiB, read from L2 once per output row.
constexpr int64_t SLICE_COLUMNS = 512;

// W8A8's largest group: its integer group sums (|sum| <= G * 255 * 128) stay below 2^24,
// exact in float32.
constexpr int64_t MAX_W8A8_GROUP = 512;

// Rows from which linear_int8 runs W8A8 when asked: one row runs W8A16, whose one-row kernel
// streams the weights faster than a pass of the lanes kernel with 7 of its 8 lanes idle
// (the head of SmolLM2-135M at g64, 2 threads: 0.68 against 1.06 ms; 2 rows: 1.28 against
// 1.08 ms; docs/engines.md).
constexpr int64_t W8A8_MIN_ROWS = 2;

// Activation rows one pass of the multi-row W4A8_GROUP and W8A8 kernels serves, one per int32 lane of
// a ymm vector (on AVX2 and AVX-512 alike).
constexpr int LANES = 8;

// What the multi-row kernels' loops need of a step: M activation rows, N output rows in
// blocks of ROWS whose weights are `block_bytes` each from `weights`.
struct Step {
  int64_t m, n, k, g;
  const void* weights;
  int64_t block_bytes;
};

// ---- steps of several activation rows (multirow.inc), once per ISA region ----------

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace multirow_avx2 {
#define FOURBIT_MULTIROW_MR 4
#define FOURBIT_MULTIROW_VNNI 0
#include "multirow.inc"
#undef FOURBIT_MULTIROW_MR
#undef FOURBIT_MULTIROW_VNNI
}  // namespace multirow_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace multirow_avx512 {
#define FOURBIT_MULTIROW_MR 8
#define FOURBIT_MULTIROW_VNNI 1
#include "multirow.inc"
#undef FOURBIT_MULTIROW_MR
#undef FOURBIT_MULTIROW_VNNI
}  // namespace multirow_avx512
#pragma GCC diagnostic pop
#pragma GCC pop_options

// x [M, K] -> the multi-row kernels' order: the rows in passes of `per_pass` (the last may
// be shorter), each pass's rows as [K / width][rows][width] (multirow.inc), pass p from
// element p * per_pass * K. K is a multiple of width.
template <typename T>
std::vector<T> interleave_rows(const T* x, int64_t m, int64_t k, int per_pass, int width) {
  std::vector<T> out(m * k);
  for (int64_t i0 = 0; i0 < m; i0 += per_pass) {
    const int64_t rows = std::min<int64_t>(per_pass, m - i0);
    T* pass = out.data() + i0 * k;
    for (int64_t c = 0; c < k / width; ++c) {
      for (int64_t i = 0; i < rows; ++i) {
        std::memcpy(pass + (c * rows + i) * width, x + (i0 + i) * k + c * width, width * sizeof(T));
      }
    }
  }
  return out;
}

// qy [M, K] int8 -> passes of LANES rows, each [K/4][LANES][4] (4 columns of every row
// side by side, lanes past the last row zero): what the multi-row W4A8_GROUP kernel loads for
// 4 columns of all its rows in one vector. Pass p from element p * LANES * K.
std::vector<int8_t> interleave_lanes(const int8_t* qy, int64_t m, int64_t k) {
  const int64_t passes = (m + LANES - 1) / LANES;
  std::vector<int8_t> out(passes * LANES * k, 0);
  for (int64_t i = 0; i < m; ++i) {
    int8_t* pass = out.data() + (i / LANES) * LANES * k;
    for (int64_t c = 0; c < k / 4; ++c) std::memcpy(pass + (c * LANES + i % LANES) * 4, qy + i * k + c * 4, 4);
  }
  return out;
}

// v [M, G'] (one value per activation row and group) -> per pass of `per_pass` rows
// [G'][8], row i of the pass in lane i, lanes past the pass's rows zero: what the multi-row
// W4A8_GROUP kernel loads for a group's rows in one vector.
std::vector<float> group_lanes(const float* v, int64_t m, int64_t groups, int per_pass) {
  const int64_t passes = (m + per_pass - 1) / per_pass;
  std::vector<float> out(passes * groups * 8, 0.f);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t gi = 0; gi < groups; ++gi) {
      out[((i / per_pass) * groups + gi) * 8 + i % per_pass] = v[i * groups + gi];
    }
  }
  return out;
}

// Decode-sized activations (at most this many elements) cross between bfloat16 and float32
// in the loops below rather than through x.to(): each aten conversion is four dispatched
// ops (to, _to_copy, empty_strided, copy_), and a bfloat16 engine's decode step makes two
// per linear (docs/engines.md has what that cost). Larger tensors take aten's parallel copy.
constexpr int64_t SMALL_CONVERSION = 1 << 16;

// x as contiguous float32; exact (every bfloat16 is a float32).
at::Tensor as_float(const at::Tensor& x) {
  if (x.scalar_type() != at::kBFloat16 || !x.is_contiguous() || x.numel() > SMALL_CONVERSION) {
    return x.to(at::kFloat).contiguous();
  }
  at::Tensor wide = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  const at::BFloat16* src = x.data_ptr<at::BFloat16>();
  float* dst = wide.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) dst[i] = static_cast<float>(src[i]);
  return wide;
}

// n float32 to bfloat16, rounded to nearest even as c10::BFloat16 does: bits + 0x7fff +
// (bit 16 of bits), the top half; a NaN becomes the quiet NaN 0x7fc0. Eight at a time,
// the last n % 8 by c10::BFloat16 itself.
FOURBIT_AVX2 void narrow_bf16(const float* src, int64_t n, at::BFloat16* out) {
  uint16_t* dst = reinterpret_cast<uint16_t*>(out);
  const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
  const __m256i quiet_nan = _mm256_set1_epi32(0x7fc0);
  const int64_t whole = n / 8 * 8;
  for (int64_t i = 0; i < whole; i += 8) {
    const __m256 v = _mm256_loadu_ps(src + i);
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
    __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(bias, odd)), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    top = _mm256_blendv_epi8(top, quiet_nan, nan);  // [8 x int32], each < 65536
    // pack 8 int32 to 8 uint16: packus works per 128-bit lane, so pack then fix the order
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(top),
                                            _mm256_extracti128_si256(top, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), packed);
  }
  for (int64_t i = whole; i < n; ++i) out[i] = at::BFloat16(src[i]);
}

// y (contiguous float32) in `dtype`; to bfloat16 rounded to nearest even, as y.to() does.
at::Tensor narrowed(const at::Tensor& y, at::ScalarType dtype) {
  if (dtype == at::kFloat) return y;
  if (dtype != at::kBFloat16 || y.numel() > SMALL_CONVERSION) return y.to(dtype);
  at::Tensor narrow = at::empty(y.sizes(), y.options().dtype(at::kBFloat16));
  narrow_bf16(y.data_ptr<float>(), y.numel(), narrow.data_ptr<at::BFloat16>());
  return narrow;
}

// x [M, K] float32 -> [M, N] float32 with 8-bit weights: W8A16 (float activations), or,
// with int8_activations and from W8A8_MIN_ROWS rows, W8A8 (x rounded to int8 per weight
// group as W4A8_GROUP rounds it, integer dot products on the multi-row lanes kernel).
at::Tensor linear_int8(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                       int64_t g, bool int8_activations) {
  TORCH_CHECK(isa() != "none", "fourbit int8: this CPU has no AVX2+FMA; use the fallback");
  TORCH_CHECK(codes.dtype() == at::kChar && codes.dim() == 2 && codes.is_contiguous(),
              "fourbit int8: codes must be contiguous int8 [N, K]");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(g > 0 && g % 16 == 0 && k % g == 0, "fourbit int8: group ", g,
              " must be a multiple of 16 that divides K=", k);
  TORCH_CHECK(!int8_activations || (g % CHUNK == 0 && g <= MAX_W8A8_GROUP), "fourbit int8: W8A8 takes groups of 64 * n up to ",
              MAX_W8A8_GROUP, " (its group sums stay exact in float32), not ", g, "; W8A16 takes any multiple of 16");
  TORCH_CHECK(scales.dtype() == at::kFloat && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({n, k / g}),
              "fourbit int8: scales must be contiguous float32 [N, K/G] = [", n, ", ", k / g, "]");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k, "fourbit int8: x must be [M, ", k, "]");
  const at::Tensor x = as_float(x_in);
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  if (int8_activations && m >= W8A8_MIN_ROWS) {
    const int64_t groups = k / g;
    std::vector<int8_t> qy(m * k);
    std::vector<float> d(m * groups), xsum(m * groups), qsum(m * groups);
    for (int64_t i = 0; i < m; ++i) {
      quantize_q8_avx2(xp + i * k, k, g, g, qy.data() + i * k, d.data() + i * groups,
                       xsum.data() + i * groups, qsum.data() + i * groups);
    }
    const std::vector<int8_t> qa = interleave_lanes(qy.data(), m, k);
    const std::vector<float> d_lanes = group_lanes(d.data(), m, groups, LANES);
    const std::vector<float> qsum_lanes = group_lanes(qsum.data(), m, groups, LANES);
    float* yp = y.data_ptr<float>();
    const Step step{m, n, k, g, cp, ROWS * k};
    const bool vnni = isa() == "avx512_vnni";
    over_blocks(n, [&](int64_t b0, int64_t b1) {
      (vnni ? multirow_avx512::w8a8 : multirow_avx2::w8a8)(step, b0, b1, cp, sp, qa.data(),
                                                          d_lanes.data(), qsum_lanes.data(), yp);
    });
    return y;
  }
  if (m >= multirow_min()) {
    const bool wide = isa() == "avx512_vnni";
    const int per_pass = wide ? multirow_avx512::MR : multirow_avx2::MR;
    const std::vector<float> xi = interleave_rows(xp, m, k, per_pass, 8);
    y.zero_();
    float* yp = y.data_ptr<float>();
    const Step step{m, n, k, g, cp, ROWS * k};
    over_blocks(n, [&](int64_t b0, int64_t b1) {
      (wide ? multirow_avx512::w8a16 : multirow_avx2::w8a16)(step, b0, b1, cp, sp, xi.data(), yp);
    });
    return y;
  }
  over_row_blocks(m, n, y.data_ptr<float>(), cp, ROWS * k,
                  [&](int64_t, const int64_t* row, int64_t i, float* out) {
    const int8_t* w[ROWS];
    const float* s[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      w[r] = cp + row[r] * k;
      s[r] = sp + row[r] * (k / g);
    }
    rows_w8a16(w, s, xp + i * k, k, g, out);
  });
  return y;
}

// ---- the op -------------------------------------------------------------------------

void check(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zeros,
           int64_t g) {
  TORCH_CHECK(g % QK == 0 && g > 0, "fourbit int4: group ", g, " is not a multiple of 32");
  TORCH_CHECK(packed.dtype() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "fourbit int4: packed must be contiguous uint8 [N, K/2]");
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  const int64_t blocks = (n + ROWS - 1) / ROWS;
  TORCH_CHECK(k % g == 0, "fourbit int4: K=", k, " is not a multiple of group ", g);
  TORCH_CHECK(g == QK || g % CHUNK == 0, "fourbit int4: group ", g, " must be 32 or a multiple of 64");
  TORCH_CHECK(scales.dtype() == at::kFloat && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({blocks, k / g, ROWS}),
              "fourbit int4: scales must be contiguous float32 [ceil(N/4), K/G, 4] = [", blocks,
              ", ", k / g, ", 4]");
  TORCH_CHECK(zeros.dtype() == at::kByte && zeros.is_contiguous() &&
                  zeros.sizes() == at::IntArrayRef({blocks, k / g, ROWS}),
              "fourbit int4: zeros must be contiguous uint8 [ceil(N/4), K/G, 4]");
}

// x [M, K] float32 -> [M, N] float32. `on`: the ISA path to run, "" for path(numerics, g, M);
// "avx2" on an AVX-512 host lets a benchmark or a test time or check both in one process.
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales,
                  const at::Tensor& zeros, int64_t g, int64_t numerics, const std::string& on) {
  TORCH_CHECK(isa() != "none", "fourbit int4: this CPU has no AVX2+FMA; use the fallback");
  check(packed, scales, zeros, g);
  TORCH_CHECK(numerics == W4A16 || numerics == W4A8 || numerics == W4A8_GROUP,
              "fourbit int4: numerics ", numerics);
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k, "fourbit int4: x must be [M, ", k, "]");
  const at::Tensor x = as_float(x_in);
  const int64_t m = x.size(0);
  const std::string own = path(numerics, g, m);
  const std::string runs = on.empty() ? own : on;
  TORCH_CHECK(runs == "avx2" || runs == own, "fourbit int4: path '", on, "' does not run numerics ",
              numerics, " at group ", g, " for ", m, " rows on this CPU (it runs '", own,
              "'; 'avx2' always does)");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const int64_t groups = k / g;

  // Per activation row: the int8 values and block scales (W4A8: per 32 columns,
  // W4A8_GROUP: per group), and the group sums of the zero-point term (every kernel but
  // the multi-row W4A16, which forms W_hat itself).
  const bool int8 = numerics != W4A16;
  const bool multi = multirow(numerics, g, m);
  const int64_t block = numerics == W4A8_GROUP ? g : QK;
  std::vector<int8_t> qy(int8 ? m * k : 0);
  std::vector<float> d(int8 ? m * (k / block) : 0);
  std::vector<float> xsum(int8 || !multi ? m * groups : 0);
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < m; ++i) {
    if (int8) {
      quantize_q8_avx2(xp + i * k, k, block, g, qy.data() + i * k, d.data() + i * (k / block),
                       xsum.data() + i * groups);
    } else if (!multi) {
      group_sums(xp + i * k, k, g, xsum.data() + i * groups);
    }
  }

  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const uint8_t* zp = zeros.data_ptr<uint8_t>();
  const bool vnni = runs == "avx512_vnni";
  if (multi) {
    const int per_pass = vnni ? multirow_avx512::MR : multirow_avx2::MR;
    const std::vector<float> xi = int8 ? std::vector<float>() : interleave_rows(xp, m, k, per_pass, 8);
    const std::vector<int8_t> qa = int8 ? interleave_lanes(qy.data(), m, k) : std::vector<int8_t>();
    const std::vector<float> d_lanes = int8 ? group_lanes(d.data(), m, groups, LANES)
                                            : std::vector<float>();
    const std::vector<float> xsum_lanes = int8 ? group_lanes(xsum.data(), m, groups, LANES)
                                               : std::vector<float>();
    y.zero_();
    float* yp = y.data_ptr<float>();
    const Step step{m, n, k, g, wp, ROWS * (k / 2)};
    over_blocks(n, [&](int64_t b0, int64_t b1) {
      if (numerics == W4A16) {
        (vnni ? multirow_avx512::w4a16 : multirow_avx2::w4a16)(step, b0, b1, wp, sp, zp, xi.data(), yp);
      } else {
        (vnni ? multirow_avx512::w4a8_group : multirow_avx2::w4a8_group)(
            step, b0, b1, wp, sp, zp, qa.data(), d_lanes.data(), xsum_lanes.data(), yp);
      }
    });
    return y;
  }
  over_row_blocks(m, n, y.data_ptr<float>(), wp, ROWS * (k / 2),
                  [&](int64_t b, const int64_t* row, int64_t i, float* out) {
    const uint8_t* w[ROWS];
    for (int r = 0; r < ROWS; ++r) w[r] = wp + row[r] * (k / 2);
    const float* sb = sp + b * groups * ROWS;
    const uint8_t* zb = zp + b * groups * ROWS;
    if (vnni && numerics == W4A16) {
      rows_w4a16_512(w, sb, zb, xp + i * k, xsum.data() + i * groups, k, g, out);
    } else if (vnni) {
      const bool per_group = numerics == W4A8_GROUP;
      rows_int8_512(per_group, w, sb, zb, qy.data() + i * k,
                    d.data() + i * (per_group ? groups : k / QK), xsum.data() + i * groups, k, g, out);
    } else if (numerics == W4A8) {
      rows_w4a8(w, sb, zb, qy.data() + i * k, d.data() + i * (k / QK), xsum.data() + i * groups,
                k, g, out);
    } else if (numerics == W4A8_GROUP) {
      rows_w4a8_group(w, sb, zb, qy.data() + i * k, d.data() + i * groups,
                      xsum.data() + i * groups, k, g, out);
    } else {
      rows_w4a16(w, sb, zb, xp + i * k, xsum.data() + i * groups, k, g, out);
    }
  });
  return y;
}

// W_hat float32 [N, K] from the packed layout (the dense path for large batches); exact:
// (q - z) is an integer of at most 5 bits and s * (q - z) is formed in one rounding-free
// float32 product when s comes from a float16 or bfloat16 scale (see quant/qweight.py).
// With bfloat16, each row is formed in float32 and rounded once (as W_hat.to(bfloat16)),
// so a bfloat16 prefill's dense product never holds, or copies, the float32 W_hat.
at::Tensor dequantize(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zeros,
                      int64_t g, bool bfloat16) {
  TORCH_CHECK(isa() != "none", "fourbit int4: this CPU has no AVX2+FMA; use the fallback");
  check(packed, scales, zeros, g);
  const int64_t n = packed.size(0), k = packed.size(1) * 2, groups = k / g;
  at::Tensor w = at::empty({n, k}, scales.options().dtype(bfloat16 ? at::kBFloat16 : at::kFloat));
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const uint8_t* zp = zeros.data_ptr<uint8_t>();
  const bool wide = isa() == "avx512_vnni";
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> row_f32(bfloat16 ? k : 0);
    for (int64_t row = n0; row < n1; ++row) {
      const int64_t lane = (row / ROWS) * groups * ROWS + row % ROWS;  // [N/4, K/G, 4]
      float* out = bfloat16 ? row_f32.data() : w.data_ptr<float>() + row * k;
      (wide ? multirow_avx512::dequantize_row : multirow_avx2::dequantize_row)(
          wp + row * (k / 2), sp + lane, zp + lane, k, g, out);
      if (bfloat16) {
        narrow_bf16(out, k, w.data_ptr<at::BFloat16>() + row * k);
      }
    }
  });
  return w;
}

// The int8 numerics' activation rounding on its own, per `block` columns (32 for W4A8,
// the group for W4A8_GROUP): [M, K] -> (int8 [M, K], d float32 [M, K/block]), so tests can
// hold the kernel to exactly the rounding it applies.
std::vector<at::Tensor> quantize_activations(const at::Tensor& x_in, int64_t block) {
  TORCH_CHECK(isa() != "none", "fourbit int4: this CPU has no AVX2+FMA");
  TORCH_CHECK(block > 0 && block % QK == 0, "fourbit int4: block ", block, " is not a multiple of 32");
  const at::Tensor x = as_float(x_in);
  TORCH_CHECK(x.dim() == 2 && x.size(1) % block == 0,
              "fourbit int4: x must be [M, K] with K a multiple of ", block);
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({m, k / block}, x.options());
  std::vector<float> xsum(k / block);
  for (int64_t i = 0; i < m; ++i) {
    quantize_q8_avx2(x.data_ptr<float>() + i * k, k, block, block, q.data_ptr<int8_t>() + i * k,
                     d.data_ptr<float>() + i * (k / block), xsum.data());
  }
  return {q, d};
}

// ---- the plugin's op -----------------------------------------------------------------
//
// fourbit::int4_linear, the one op every quantized linear of a compiled vLLM model calls
// (fourbit/vllm_plugin/ops.py describes its arguments and paths; int4_cpu.py, "The
// plugin's op", why it is here and what it saves). Its decode path -- a batch below the
// threshold on fourbit's kernel, the same rule as ops.py's int4_linear_impl -- is decided
// and run here; every other path (the dense expansion for prefill, tinygemm) is the
// Python op fourbit::int4_linear_general, called through the dispatcher.

constexpr int64_t KERNEL_TINYGEMM = 0;  // knobs[3]; fourbit's numerics are codes 1 + Numerics
constexpr int64_t MODE_NEVER = 0;       // knobs[1]: never the dense path

std::array<std::atomic<int64_t>, 3> kernel_calls{};  // per Numerics, for the plugin's tests

at::Tensor int4_linear_op(const at::Tensor& x, const at::Tensor& packed,
                          const at::Tensor& scales_and_zeros, const at::Tensor& codes,
                          const at::Tensor& scales, const at::Tensor& offsets,
                          const at::Tensor& zeros, const at::Tensor& knobs, int64_t group_size,
                          int64_t out_features) {
  TORCH_CHECK(knobs.dtype() == at::kLong && knobs.numel() == 4 && knobs.is_contiguous(),
              "fourbit int4_linear: knobs must be int64 [threshold, mode, dtype, kernel]");
  const int64_t* knob = knobs.data_ptr<int64_t>();
  const int64_t threshold = knob[0], mode = knob[1], kernel = knob[3];
  const int64_t rows = x.size(0);
  const bool dense = mode != MODE_NEVER && rows >= threshold;
  if (kernel != KERNEL_TINYGEMM && rows > 0 && !dense) {
    const int64_t numerics = kernel - 1;
    TORCH_CHECK(numerics >= W4A16 && numerics <= W4A8_GROUP, "fourbit int4_linear: kernel ", kernel);
    kernel_calls[numerics]++;
    at::Tensor y = linear(x, packed, scales, zeros, group_size, numerics, "");  // [M, N] float32
    TORCH_CHECK(y.size(1) == out_features, "fourbit int4_linear: ", y.size(1),
                " packed rows, out_features ", out_features);
    return narrowed(y, x.scalar_type());
  }
  static const auto general =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fourbit::int4_linear_general", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, int64_t, int64_t)>();
  return general.call(x, packed, scales_and_zeros, codes, scales, offsets, zeros, knobs,
                      group_size, out_features);
}

// Calls of the decode path per numerics since the last reset (reset = true clears them).
std::vector<int64_t> op_kernel_calls(bool reset) {
  std::vector<int64_t> counts;
  for (auto& count : kernel_calls) counts.push_back(reset ? count.exchange(0) : count.load());
  return counts;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fourbit, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales_and_zeros, Tensor codes, "
        "Tensor scales, Tensor offsets, Tensor zeros, Tensor knobs, int group_size, "
        "int out_features) -> Tensor");
  m.impl("int4_linear", c10::DispatchKey::CPU, TORCH_FN(int4_linear_op));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fourbit's CPU 4-bit linear (W4A16 / W4A8 / W4A8_GROUP on AVX2 and AVX-512 VNNI) and 8-bit W8A16; see fourbit/kernels/int4_cpu.py";
  m.def("isa", &isa, "the best ISA path this CPU has: 'avx512_vnni', 'avx2' or 'none'");
  m.def("path", &path, "the ISA path a call with these numerics, group size and rows runs",
        py::arg("numerics"), py::arg("g"), py::arg("rows") = 1);
  m.def("linear", &linear, "x [M, K] @ W_hat^T -> [M, N] float32, on an ISA path ('' = path())",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("zeros"), py::arg("g"),
        py::arg("numerics"), py::arg("on") = "");
  m.def("dequantize", &dequantize, "W_hat [N, K] from the packed layout, float32 or bfloat16",
        py::arg("packed"), py::arg("scales"), py::arg("zeros"), py::arg("g"),
        py::arg("bfloat16") = false);
  m.def("quantize_activations", &quantize_activations, "the int8 rounding of x [M, K] per block columns");
  m.def("multirow_min", &multirow_min, "rows from which a step runs the multi-row kernels");
  m.def("op_kernel_calls", &op_kernel_calls, "fourbit::int4_linear's decode-path calls per numerics",
        py::arg("reset") = false);
  m.def("linear_int8", &linear_int8, "x [M, K] @ W_hat^T -> [M, N] float32, 8-bit weights (W8A16, or W8A8)",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("g"),
        py::arg("int8_activations") = false);
}
