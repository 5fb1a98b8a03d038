// eagle::quant_panel_linear(x, panels, bias, out_features, qtype, input_bits, streamed):
// out[..., N] = x[..., K] . W[N, K]^T (+ bias) in float32, for the 1 to 16 rows of a decode step or a tree
// verification, with W kept in its GGUF blocks (Q4_1 or Q8_0, 32 weights a block) and multiplied as integers; built
// with panel_linear.cpp into one library (eagle/kernels/panel_kernel.py), packed by eagle/kernels/quant_panels.py.
// `streamed` marks a weight that a whole pass of its model evicts before it is read again (a base's; see the
// tiling's stream_nta below).
//
// Arithmetic, per row m and GGUF block b (32 consecutive k) of column j, with L = 32767 (input_bits 16, Q4_1 only) or
// 127 (input_bits 8: llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 products):
//   the row's 32 inputs are rounded against their largest magnitude: x ~ s[m, b] * xq, s = max |x| / L, |xq| <= L;
//   isum = sum_k q[k, j] * xq[m, k], exact in int32 (|isum| <= 32 * 128 * 32767 < 2^31) by 16-bit dot products
//   (vpdpwssd, or vpmaddwd + vpaddd; two k a lane) or 8-bit ones (vpdpbusd: unsigned bytes times signed inputs, four
//   k a lane; without VNNI vpmaddubsw's int16 pair sums for Q4_1's nibbles, added as int16 over a block and widened by
//   vpmaddwd, |q * xq| * 2 * 8 < 2^15 so nothing saturates or wraps; for Q8_0's, vpmaddubsw on |q| and xq signed as q
//   with AVX2, or two vpmaddwd on the bytes widened to 16 bits with AVX-512); Q8_0's signed q are stored as
//   u = q + 128, so a VNNI product sums u * xq and takes 128 * sum(xq) back off, exactly;
//   Q4_1 (w = d * q + m): acc += (float(isum) * s[m, b]) * d[b, j], then acc += sx[m, b] * m[b, j], where
//   sx = s[m, b] * (the integer sum of the block's xq), so each row is multiplied exactly as its rounded inputs
//   s * xq (the minimum's term rounded like the rest: its rounding errors cancel against the scale's, w being
//   centred where d * q is not); Q8_0 (w = d * q): the first term only.
// Invariants:
// - The weights are exactly gguf-py's (q, d and m as stored); only the inputs are rounded, to `input_bits` a block
//   (|x - s * xq| <= s / 2 * (1 + 2^-8)), the bound the tests hold the kernel to.
// - A row's result depends on that row alone: the same operations in the same order whatever the number of rows
//   and however they are tiled (batch-invariant), so a verify pass gives each row what a one-row step gives it.
//
// Layout of a panel (NB = 2 * VL columns, zero columns past N), block after block (K / 32 of them):
//   Q4_1: d[NB] fp16, m[NB] fp16, then 4 groups of 8 k, each NB uint32: the word of column j holds the group's 8 q
//         as nibbles, k + 2p in bits 4p..4p+3 and k + 2p + 1 in bits 16+4p..19+4p, so (word >> 4p) & 0x000F000F
//         is the int16 pair (q[k + 2p], q[k + 2p + 1]), and (word >> 4h) & 0x0F0F0F0F four bytes of q (PERM8);
//   Q8_0: d[NB] fp16, then 4 groups of 8 k, each 2 x NB uint32: word h of column j holds q + 128 of the group's
//         k + PERM8[4h + i] in byte i, matching the 8-bit inputs' order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

constexpr int64_t Q4_1 = 3, Q8_0 = 8;  // ggml's type numbers (gguf.GGMLQuantizationType)
constexpr int QK = 32;                 // weights per block
// PERM8 = (0, 4, 1, 5, 2, 6, 3, 7): the order of a group's 8 inputs (8-bit) that matches the nibbles of its Q4_1
// weight word as bytes: (word & 0x0F0F0F0F) holds q[k], q[k + 4], q[k + 1], q[k + 5] and (word >> 4) & 0x0F0F0F0F
// q[k + 2], q[k + 6], q[k + 3], q[k + 7].
// A running sum as the program orders it: integer vector adds are associative, and GCC would otherwise turn a
// block's unrolled adds into one tree over all its products, live at once (spilled: 16 registers on AVX2).
template <typename V>
static inline V in_order(V a) {
  __asm__("" : "+v"(a));
  return a;
}

#ifdef __AVX512F__
constexpr int VL = 16;
typedef __m512 vf;
typedef __m512i vi;
static inline vf from_fp16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
static inline vi load(const uint8_t* p) { return _mm512_loadu_si512(p); }
static inline vi nibble_pairs(vi w, int p) { return _mm512_and_si512(_mm512_srli_epi32(w, 4 * p), _mm512_set1_epi32(0x000F000F)); }
static inline vi nibbles(vi w, int p) { return _mm512_and_si512(_mm512_srli_epi32(w, 4 * p), _mm512_set1_epi32(0x0F0F0F0F)); }
static inline vi bcast32(const void* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }  // 4 bytes
// dot8x2: two products of unsigned bytes u <= 15 (Q4_1's nibbles) times signed bytes |s| <= 127, four a lane, added to
// a block's running sum, which widen8 turns into int32 lanes at the block's end: with VNNI int32 all along; without,
// vpmaddubsw's int16 pair sums (|u0 s0 + u1 s1| <= 3810) added as int16, eight a block (<= 30480 < 2^15: exact), and
// widened once a block by vpmaddwd. dot8u, then unbias8u once a block: the int32 sum of q * s for Q8_0's stored
// u = q + 128 (sum u * s, less 128 * sum(s); or, on AVX2 without VNNI, q * s directly as llama.cpp does: vpmaddubsw
// on |q| and s signed as q, pair sums |.| <= 2 * 128 * 127 < 2^15).
#ifdef __AVX512VNNI__
static inline vi dot(vi acc, vi a, vi b) { return _mm512_dpwssd_epi32(acc, a, b); }
static inline vi dot8x2(vi acc, vi u0, vi s0, vi u1, vi s1) { return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, u0, s0), u1, s1); }
static inline vi widen8(vi acc) { return acc; }
static inline vi dot8u(vi acc, vi u, vi s) { return _mm512_dpbusd_epi32(acc, u, s); }
#else
static inline vi dot(vi acc, vi a, vi b) { return in_order(_mm512_add_epi32(acc, _mm512_madd_epi16(a, b))); }
static inline vi dot8x2(vi acc, vi u0, vi s0, vi u1, vi s1) {
  return in_order(_mm512_add_epi16(acc, _mm512_add_epi16(_mm512_maddubs_epi16(u0, s0), _mm512_maddubs_epi16(u1, s1))));
}
static inline vi widen8(vi acc) { return _mm512_madd_epi16(acc, _mm512_set1_epi16(1)); }
static inline vi dot8u(vi acc, vi u, vi s) {  // bytes 0, 2 then 1, 3 of each lane widened to 16 bits
  const vi even = _mm512_madd_epi16(_mm512_and_si512(u, _mm512_set1_epi16(0x00FF)), _mm512_srai_epi16(_mm512_slli_epi16(s, 8), 8));
  return in_order(_mm512_add_epi32(_mm512_add_epi32(acc, even), _mm512_madd_epi16(_mm512_srli_epi16(u, 8), _mm512_srai_epi16(s, 8))));
}
#endif
static inline vi unbias8u(vi acc, int32_t xsum) { return _mm512_sub_epi32(acc, _mm512_set1_epi32(128 * xsum)); }
static inline vi izero() { return _mm512_setzero_si512(); }
static inline vf tofloat(vi a) { return _mm512_cvtepi32_ps(a); }
static inline vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf bcast(float a) { return _mm512_set1_ps(a); }
static inline vf zero() { return _mm512_setzero_ps(); }
static inline void store(float* p, vf a) { _mm512_storeu_ps(p, a); }
// A block's 32 inputs: their largest magnitude.
static inline float block_amax(const float* xb) {
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb)), _mm512_abs_ps(_mm512_loadu_ps(xb + 16))));
}
// xb[k] * inv rounded to the nearest integer (ties to even: the default rounding mode), stored as int16, or as int8 in
// PERM8's order; returns the sum of the 32 integers
static inline int32_t round16(const float* xb, float inv, int16_t* out) {
  vi sum = izero();
  for (int h = 0; h < 2; h++) {
    const vi q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * h), bcast(inv)));
    _mm256_storeu_si256((__m256i*)(out + 16 * h), _mm512_cvtsepi32_epi16(q));
    sum = _mm512_add_epi32(sum, q);
  }
  return _mm512_reduce_add_epi32(sum);
}
static inline int32_t round8(const float* xb, float inv, int8_t* out) {
  const vi perm = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);  // PERM8, twice
  vi sum = izero();
  for (int h = 0; h < 2; h++) {
    const vi q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutexvar_ps(perm, _mm512_loadu_ps(xb + 16 * h)), bcast(inv)));
    _mm_storeu_si128((__m128i*)(out + 16 * h), _mm512_cvtsepi32_epi8(q));
    sum = _mm512_add_epi32(sum, q);
  }
  return _mm512_reduce_add_epi32(sum);
}
// the vectors of columns (NV) a tile holds: rows x NV int32 sums in registers through a block, the float32 sums
// touched once a block; wide tiles (two panels, of up to WIDE_MR rows) where the tiling says so, else one panel
constexpr int NV_WIDE = 4, NV_ONE = 2;
constexpr int MR = 8;       // rows of a tile at most
constexpr int WIDE_MR = 2;  // rows of a wide tile at most: 2 x 4 sums and their float32 twins fill the 32 registers
#else
constexpr int VL = 8;
typedef __m256 vf;
typedef __m256i vi;
static inline vf from_fp16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
static inline vi load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline vi nibble_pairs(vi w, int p) { return _mm256_and_si256(_mm256_srli_epi32(w, 4 * p), _mm256_set1_epi32(0x000F000F)); }
static inline vi nibbles(vi w, int p) { return _mm256_and_si256(_mm256_srli_epi32(w, 4 * p), _mm256_set1_epi32(0x0F0F0F0F)); }
static inline vi bcast32(const void* p) { int32_t v; std::memcpy(&v, p, 4); return _mm256_set1_epi32(v); }  // 4 bytes
#ifdef __AVXVNNI__
static inline vi dot(vi acc, vi a, vi b) { return _mm256_dpwssd_avx_epi32(acc, a, b); }
static inline vi dot8x2(vi acc, vi u0, vi s0, vi u1, vi s1) { return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, u0, s0), u1, s1); }
static inline vi widen8(vi acc) { return acc; }
static inline vi dot8u(vi acc, vi u, vi s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
static inline vi unbias8u(vi acc, int32_t xsum) { return _mm256_sub_epi32(acc, _mm256_set1_epi32(128 * xsum)); }
#else
static inline vi dot(vi acc, vi a, vi b) { return in_order(_mm256_add_epi32(acc, _mm256_madd_epi16(a, b))); }
static inline vi dot8x2(vi acc, vi u0, vi s0, vi u1, vi s1) {
  return in_order(_mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1))));
}
static inline vi widen8(vi acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
static inline vi dot8u(vi acc, vi u, vi s) {  // q = u ^ 0x80 as int8; |q| * (s signed as q) = q * s
  const vi q = _mm256_xor_si256(u, _mm256_set1_epi8(-128));
  const vi pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(s, q));
  return in_order(_mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))));
}
static inline vi unbias8u(vi acc, int32_t) { return acc; }  // dot8u summed q * s
#endif
static inline vi izero() { return _mm256_setzero_si256(); }
static inline vf tofloat(vi a) { return _mm256_cvtepi32_ps(a); }
static inline vf fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf bcast(float a) { return _mm256_set1_ps(a); }
static inline vf zero() { return _mm256_setzero_ps(); }
static inline void store(float* p, vf a) { _mm256_storeu_ps(p, a); }
static inline float block_amax(const float* xb) {
  const vf sign = _mm256_set1_ps(-0.f);
  vf mx = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb));
  for (int i = 1; i < 4; i++) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * i)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}
static inline int32_t isum8(vi a) {  // the 8 int32 of a
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
static inline int32_t round16(const float* xb, float inv, int16_t* out) {
  vi c[4];
  for (int i = 0; i < 4; i++) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * i), bcast(inv)));
  for (int h = 0; h < 2; h++)  // packs works within 128-bit lanes: 64-bit quarters (0, 2, 1, 3) put k back in order
    _mm256_storeu_si256((__m256i*)(out + 16 * h), _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2 * h], c[2 * h + 1]), 0xD8));
  return isum8(_mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3])));
}
static inline int32_t round8(const float* xb, float inv, int8_t* out) {
  const vi perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // PERM8; also the dwords' order after the packs
  vi c[4];
  for (int i = 0; i < 4; i++)
    c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(xb + 8 * i), perm), bcast(inv)));
  const vi b = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  _mm256_storeu_si256((__m256i*)out, _mm256_permutevar8x32_epi32(b, perm));
  return isum8(_mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3])));
}
constexpr int NV_WIDE = 2, NV_ONE = 1;  // one panel a wide tile, half of one otherwise
constexpr int MR = 4;  // tiles of 8 rows spill the 16 registers (docs/history/2026-11-26-q4-1-16-bit-inputs-row-attention.md)
constexpr int WIDE_MR = 4;  // a wide tile's float32 sums spill, touched once a block; its block sums stay in registers
#endif
constexpr int NB = 2 * VL;  // columns of a panel
constexpr int64_t block_bytes(int64_t qtype) { return qtype == Q4_1 ? 20 * NB : 34 * NB; }

// How the tiles cover the panels: wide tiles (NV_WIDE vectors of columns) for calls of up to `wide_rows` rows (0 to
// WIDE_MR; tiles of more rows take one panel), and how far ahead (bytes) a tile prefetches its panels' blocks into L1
// at each block (the hardware prefetcher alone left one row streaming below the machine's bandwidth; a prefetch past
// the end never faults), and whether a streamed weight's blocks (a call with `streamed`: a base's, whose whole pass
// outgrows the caches before the weight is read again) are prefetched non-temporally, so that they displace less of
// what is reused (the KV cache, a draft head's weights). Speed only: a column's sums are the same operations in the
// same order whatever the tiling. Set once per process from a measurement on the machine (eagle/tuning/tuner.py,
// panel_tiling); these defaults until then.
std::atomic<int64_t> g_wide_rows{WIDE_MR}, g_prefetch{16384};
std::atomic<bool> g_stream_nta{false};

// The 8-bit products of a weight type over a group (two words of four bytes a lane): dot8x2 for Q4_1's nibbles
// (<= 15; the block's sum widened by widen8), dot8u for Q8_0's bytes (any value)
template <int64_t QT>
static inline vi dot8_of(vi acc, vi u0, vi s0, vi u1, vi s1) {
  if constexpr (QT == Q4_1) return dot8x2(acc, u0, s0, u1, s1);
  else return dot8u(dot8u(acc, u0, s0), u1, s1);
}

// A block's 8-bit sum as int32 lanes of sum(q * xq), from dot8_of's running sum (xsum: the block's sum of xq)
template <int64_t QT>
static inline vi finish8_of(vi acc, int32_t xsum) {
  if constexpr (QT == Q4_1) return widen8(acc);
  else return unbias8u(acc, xsum);
}

// The rows' inputs as the kernel multiplies them, block-major (a block's rows side by side, so a tile reaches each
// row's inputs at a constant offset from one pointer): xq [K / 32, M, 32] int16 or int8, s, (Q4_1) sx [K / 32, M]
// float32 and (8-bit) xsum [K / 32, M] int32. A tile's view starts at its first row; `stride` = M.
struct Inputs {
  const int16_t* xq;     // 16-bit inputs, or
  const int8_t* xq8;     // 8-bit inputs, each group of 8 k in the order of PERM8
  const float* s;
  const float* sx;
  const int32_t* xsum;  // sum(xq) of a block (8-bit)
  int64_t K;
  int64_t stride;    // rows between one block's inputs and the next's (M)
  int64_t prefetch;  // bytes ahead (the tiling's)
  bool nta;          // prefetch without temporal locality (a streamed weight, where the tiling says so)
};

// x [M, K] float32 -> xq (int16, or int8 in PERM8's order), s, sx, xsum, block-major (Inputs; see the file's head):
// per row and block, s = max |x| / L, xq = round-to-nearest-even(x * (L / max |x|)) (0 where the block is 0),
// xsum = sum(xq), sx = s * xsum.
template <int XB>
void quantize_rows(const float* x, int64_t M, int64_t K, void* xq, float* s, float* sx, int32_t* xsum) {
  constexpr float L = XB == 16 ? 32767.f : 127.f;
  const int64_t nblocks = K / QK;
  for (int64_t m = 0; m < M; m++)
    for (int64_t b = 0; b < nblocks; b++) {
      const float* xb = x + m * K + b * QK;
      const int64_t i = b * M + m;  // the block's place in the outputs
      const float amax = block_amax(xb), inv = amax > 0.f ? L / amax : 0.f;
      const int32_t isum = XB == 16 ? round16(xb, inv, static_cast<int16_t*>(xq) + i * QK)
                                    : round8(xb, inv, static_cast<int8_t*>(xq) + i * QK);
      s[i] = amax / L, sx[i] = s[i] * static_cast<float>(isum), xsum[i] = isum;
    }
}

// ROWS x (NV * VL) outputs of consecutive panels (panel stride `pstride` bytes) from the h0-th vector of columns
// of the first (0 or 1); out [ROWS, ncols] (row stride ldo) from that column.
template <int64_t QT, int XB, int ROWS, int NV>
void tile(const Inputs& in, const uint8_t* panel, int64_t pstride, float* out, int64_t ldo, const float* bias,
          int ncols, int h0) {
  constexpr int NP = (NV + 1) / 2;  // panels read (at h0 = 0)
  constexpr int64_t BS = block_bytes(QT);
  const int64_t nblocks = in.K / QK;
  vf acc[ROWS][NV];
  for (int m = 0; m < ROWS; m++)
    for (int v = 0; v < NV; v++) acc[m][v] = zero();
  for (int64_t b = 0; b < nblocks; b++) {
    for (int p = 0; p < NP; p++)
      for (int64_t i = 0; i < BS; i += 64) {
        const uint8_t* ahead = panel + p * pstride + b * BS + in.prefetch + i;
        if (in.nta) __builtin_prefetch(ahead, 0, 0);
        else __builtin_prefetch(ahead, 0, 3);
      }
    const uint8_t* blk[NV];  // the block of vector v's panel, and the vector's offset in it (columns)
    int col[NV];
    for (int v = 0; v < NV; v++) blk[v] = panel + ((h0 + v) / 2) * pstride + b * BS, col[v] = ((h0 + v) % 2) * VL;
    const int64_t bi = b * in.stride;  // the block's first row in s, sx, xsum; times 32 in xq
    const int16_t* xb = in.xq + bi * QK;
    vi isum[ROWS][NV];
    for (int m = 0; m < ROWS; m++)
      for (int v = 0; v < NV; v++) isum[m][v] = izero();
    if constexpr (XB == 8) {  // four bytes a lane in PERM8's order: Q4_1's nibbles, or Q8_0's u = q + 128
      const int8_t* xb8 = in.xq8 + bi * QK;
#pragma GCC unroll 4
      for (int g = 0; g < QK / 8; g++) {
        vi w[2][NV];
        for (int v = 0; v < NV; v++) {
          if constexpr (QT == Q4_1) {
            const vi word = load(blk[v] + 4 * NB + (g * NB + col[v]) * 4);
            w[0][v] = nibbles(word, 0), w[1][v] = nibbles(word, 1);
          } else {
            for (int h = 0; h < 2; h++) w[h][v] = load(blk[v] + 2 * NB + ((2 * g + h) * NB + col[v]) * 4);
          }
        }
#pragma GCC unroll 8
        for (int m = 0; m < ROWS; m++) {
          const vi x0 = bcast32(xb8 + m * QK + 8 * g), x1 = bcast32(xb8 + m * QK + 8 * g + 4);
          for (int v = 0; v < NV; v++) isum[m][v] = dot8_of<QT>(isum[m][v], w[0][v], x0, w[1][v], x1);
        }
      }
      for (int m = 0; m < ROWS; m++)
        for (int v = 0; v < NV; v++) isum[m][v] = finish8_of<QT>(isum[m][v], in.xsum[bi + m]);
    } else {
      static_assert(QT == Q4_1, "Q8_0 blocks take 8-bit inputs");
      for (int g = 0; g < QK / 8; g++) {
        vi words[NV];
        for (int v = 0; v < NV; v++) words[v] = load(blk[v] + 4 * NB + (g * NB + col[v]) * 4);
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
          vi w[NV];
          for (int v = 0; v < NV; v++) w[v] = nibble_pairs(words[v], p);
#pragma GCC unroll 8
          for (int m = 0; m < ROWS; m++) {
            const vi xp = bcast32(xb + m * QK + 8 * g + 2 * p);
            for (int v = 0; v < NV; v++) isum[m][v] = dot(isum[m][v], w[v], xp);
          }
        }
      }
    }
    for (int v = 0; v < NV; v++) {
      const vf d = from_fp16(reinterpret_cast<const uint16_t*>(blk[v]) + col[v]);
      for (int m = 0; m < ROWS; m++) acc[m][v] = fma(mul(tofloat(isum[m][v]), bcast(in.s[bi + m])), d, acc[m][v]);
      if constexpr (QT == Q4_1) {
        const vf mn = from_fp16(reinterpret_cast<const uint16_t*>(blk[v] + 2 * NB) + col[v]);
        for (int m = 0; m < ROWS; m++) acc[m][v] = fma(bcast(in.sx[bi + m]), mn, acc[m][v]);
      }
    }
  }
  for (int m = 0; m < ROWS; m++) {
    float row[NV * VL];
    for (int v = 0; v < NV; v++) store(row + v * VL, acc[m][v]);
    if (bias)
      for (int j = 0; j < ncols; j++) row[j] += bias[j];
    std::memcpy(out + m * ldo, row, ncols * sizeof(float));
  }
}

using TileFn = void (*)(const Inputs&, const uint8_t*, int64_t, float*, int64_t, const float*, int, int);

// tile<QT, XB, rows, NV> for a run-time rows in 1..sizeof...(R)
template <int64_t QT, int XB, int NV, int... R>
TileFn tile_for(int rows, std::integer_sequence<int, R...>) {
  TileFn fn = nullptr;
  ((rows == R + 1 ? (fn = &tile<QT, XB, R + 1, NV>, 0) : 0), ...);
  return fn;
}

template <int64_t QT, int XB>
TileFn tile_of(int rows, int nv) {
  if (nv == NV_WIDE) return tile_for<QT, XB, NV_WIDE>(rows, std::make_integer_sequence<int, WIDE_MR>{});
  if (nv == 2) return tile_for<QT, XB, 2>(rows, std::make_integer_sequence<int, MR>{});
  return tile_for<QT, XB, 1>(rows, std::make_integer_sequence<int, MR>{});
}

template <int64_t QT, int XB>
void run(const Inputs& in, int64_t M, const uint8_t* wp, int64_t P, int64_t N, const float* bp, float* op) {
  if (M == 0) return;
  const int64_t pstride = in.K / QK * block_bytes(QT);
  const int64_t wide_rows = g_wide_rows.load(std::memory_order_relaxed);
  const auto nv_for = [wide_rows](int64_t rows) { return rows <= wide_rows ? NV_WIDE : NV_ONE; };
  const int nv_all = nv_for(std::min<int64_t>(MR, M));
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end;) {
      const int np = (nv_all == 4 && p + 1 < end) ? 2 : 1;  // panels this step (NV 4: two panels a tile)
      const int pcols = static_cast<int>(std::min<int64_t>(np * NB, N - p * NB));
      const uint8_t* panel = wp + p * pstride;
      for (int64_t m0 = 0; m0 < M; m0 += MR) {  // a panel's next tile of rows reads it from cache
        const int rows = static_cast<int>(std::min<int64_t>(MR, M - m0));
        const int nv = std::min(nv_for(rows), 2 * np);  // vectors of columns a tile covers
        const TileFn fn = tile_of<QT, XB>(rows, nv);
        const Inputs rows_in{XB == 16 ? in.xq + m0 * QK : nullptr, XB == 8 ? in.xq8 + m0 * QK : nullptr,
                             in.s + m0, in.sx + m0, in.xsum + m0, in.K, in.stride, in.prefetch, in.nta};
        for (int h0 = 0; h0 < 2 * np && h0 * VL < pcols; h0 += nv)
          fn(rows_in, panel, pstride, op + m0 * N + p * NB + h0 * VL, N, bp ? bp + p * NB + h0 * VL : nullptr,
             std::min(nv * VL, pcols - h0 * VL), h0);
      }
      p += np;
    }
  });
}

at::Tensor quant_panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                              int64_t out_features, int64_t qtype, int64_t input_bits, bool streamed) {
  TORCH_CHECK(qtype == Q4_1 || qtype == Q8_0, "eagle::quant_panel_linear: qtype ", qtype,
              " is not Q4_1 (3) or Q8_0 (8)");
  TORCH_CHECK(input_bits == 8 || (input_bits == 16 && qtype == Q4_1), "eagle::quant_panel_linear: input_bits ",
              input_bits, " is not 8, or 16 with Q4_1 weights");
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kByte,
              "eagle::quant_panel_linear takes float32 x and uint8 panels (got ", x.scalar_type(), ", ",
              panels.scalar_type(), ")");
  const int64_t K = x.size(-1), N = out_features;
  TORCH_CHECK(K % QK == 0, "eagle::quant_panel_linear: in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(panels.dim() == 2 && panels.size(1) == K / QK * block_bytes(qtype) && panels.size(0) * NB >= N &&
                  (panels.size(0) - 1) * NB < N,
              "eagle::quant_panel_linear: panels must be [ceil(N / ", NB, "), K / 32 * ", block_bytes(qtype),
              "] for this build and qtype, got ", panels.sizes(), " for x ", x.sizes(), " and N = ", N,
              "; pack the blocks with eagle.kernels.quant_panels.pack");
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = panels.contiguous();
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == N,
                "eagle::quant_panel_linear: bias must be float32 of N = ", N, " elements");
  }
  const int64_t M = K ? x.numel() / K : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
  std::vector<float> s(M * (K / QK)), sx(M * (K / QK));
  std::vector<int32_t> xsum(M * (K / QK));
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t prefetch = g_prefetch.load(std::memory_order_relaxed);
  const bool nta = streamed && g_stream_nta.load(std::memory_order_relaxed);
  if (input_bits == 8) {
    std::vector<int8_t> xq(M * K);
    quantize_rows<8>(xc.data_ptr<float>(), M, K, xq.data(), s.data(), sx.data(), xsum.data());
    const Inputs in{nullptr, xq.data(), s.data(), sx.data(), xsum.data(), K, M, prefetch, nta};
    (qtype == Q4_1 ? run<Q4_1, 8> : run<Q8_0, 8>)(in, M, wp, panels.size(0), N, bp, op);
  } else {
    std::vector<int16_t> xq(M * K);
    quantize_rows<16>(xc.data_ptr<float>(), M, K, xq.data(), s.data(), sx.data(), xsum.data());
    const Inputs in{xq.data(), nullptr, s.data(), sx.data(), xsum.data(), K, M, prefetch, nta};
    run<Q4_1, 16>(in, M, wp, panels.size(0), N, bp, op);
  }
  return out;
}

int64_t quant_panel_width() { return NB; }

void quant_panel_set_tiling(int64_t wide_rows, int64_t prefetch, bool stream_nta) {
  TORCH_CHECK(wide_rows >= 0 && wide_rows <= WIDE_MR, "eagle::quant_panel_set_tiling: wide_rows must be 0 to ",
              WIDE_MR, " in this build, got ", wide_rows);
  TORCH_CHECK(prefetch >= 0 && prefetch % 64 == 0 && prefetch <= (1 << 20),
              "eagle::quant_panel_set_tiling: prefetch must be a multiple of 64 bytes in [0, 1 MiB], got ", prefetch);
  g_wide_rows.store(wide_rows), g_prefetch.store(prefetch), g_stream_nta.store(stream_nta);
}

std::vector<int64_t> quant_panel_tiling() { return {g_wide_rows.load(), g_prefetch.load(), g_stream_nta.load()}; }

int64_t quant_panel_wide_rows() { return WIDE_MR; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("quant_panel_linear(Tensor x, Tensor panels, Tensor? bias, int out_features, int qtype, int input_bits=8, bool streamed=False) -> Tensor");
  m.def("quant_panel_width() -> int");
  m.def("quant_panel_set_tiling(int wide_rows, int prefetch, bool stream_nta=False) -> ()");
  m.def("quant_panel_tiling() -> int[]");
  m.def("quant_panel_wide_rows() -> int");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) { m.impl("quant_panel_linear", quant_panel_linear); }
TORCH_LIBRARY_IMPL(eagle, CompositeExplicitAutograd, m) {
  m.impl("quant_panel_width", quant_panel_width);
  m.impl("quant_panel_set_tiling", quant_panel_set_tiling);
  m.impl("quant_panel_tiling", quant_panel_tiling);
  m.impl("quant_panel_wide_rows", quant_panel_wide_rows);
}
