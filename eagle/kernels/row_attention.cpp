// eagle::row_attention(q, k, v, mask, scale): softmax(q k^T * scale + mask) v for the few rows of a decode step, a
// tree verification or a prefill, each row computed on its own; built with panel_linear.cpp into one library
// (eagle/kernels/panel_kernel.py), used by eagle/kernels/row_attention.py.
//
// Invariant (batch invariance): a row's output depends only on its query and on the sequence of keys it may see
// (mask value above BLOCKED), taken in cache order with the blocked ones left out. A tree node whose ancestors are
// the tokens greedy decoding would have put before it gets, bit for bit, what the one-row step of that token gets:
// the same keys in the same order, the same operations. (Library attention sums a row over every cached position
// in vector lanes fixed by position, so the masked gaps of a tree shift the lanes of the later keys.)
//
// Per row and query head: the allowed keys gathered (n of them) and split in ceil(n / CHUNK) chunks of equal size
// (a multiple of VL, the last one shorter), each chunk a task of its own (with the key/value head's G query heads),
// so that a one-row step's few heads still spread over the threads; the rows whose chunk holds the same keys as row
// 0's (a tree's rows over their shared context) make one task of it, which reads each key and value row once for
// all of their query heads. Per chunk: scores s[c] = dot(q, k[c]) * scale + mask, each dot fused-multiply-added in
// VL lanes over d then the lanes summed in a fixed order (VL keys at a time, the same sums: block_dots); the chunk's
// max m; p[c] = exp(s[c] - m) (a polynomial, vectorised); their sum l in VL lanes by c then in a fixed order;
// o = sum_c p[c] v[c] fused-multiply-added in c order. The row's output: its chunks' o and l weighted by
// exp(m_j - max_j m_j), summed in chunk order, o / l (with one chunk exactly o / l).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

namespace {

#ifdef __AVX512F__
constexpr int VL = 16;
#else
constexpr int VL = 8;
#endif
typedef float vec __attribute__((vector_size(VL * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(VL * sizeof(int32_t))));
typedef float vec_u __attribute__((vector_size(VL * sizeof(float)), aligned(4), may_alias));
constexpr float BLOCKED = -1e30f;  // an additive mask value at or below this hides the key (finfo.min, -inf)
constexpr int64_t CHUNK = 128;    // keys a task at most: a row's n keys in ceil(n / CHUNK) chunks of equal size

static inline vec loadu(const float* p) { return *reinterpret_cast<const vec_u*>(p); }
static inline void storeu(float* p, vec a) { *reinterpret_cast<vec_u*>(p) = a; }
static inline vec splat(float a) { return vec{} + a; }
// a * b + c rounded once, spelled out so that a key's score has the same bits in a block and in the tail whatever
// the compiler contracts
static inline vec fmadd(vec a, vec b, vec c) {
#if defined(__AVX512F__)
  return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  vec r;
  for (int l = 0; l < VL; l++) r[l] = std::fma(a[l], b[l], c[l]);
  return r;
#endif
}
static inline vec vmax(vec a, vec b) { return a > b ? a : b; }
static inline float lanes_max(vec a) {  // exact in any order
  float m = a[0];
  for (int l = 1; l < VL; l++) m = std::max(m, a[l]);
  return m;
}
static inline float lanes_sum(vec a) {  // a fixed order: pairwise halves, lane i + w onto lane i
  typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
  typedef float v4 __attribute__((vector_size(4 * sizeof(float))));
#ifdef __AVX512F__
  const v8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const v8 b = a;
#endif
  const v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// e^x for x <= 0 (scores minus their max): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p of degree 6
// (the series' remainder below 1.3e-7 of the result); x below -87 gives 0.
static inline vec exp_nonpositive(vec x) {
  const vec n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f + splat(-0.5f), ivec), vec);
  // n = round-half-down(x log2 e) without a rounding intrinsic: truncation toward zero of x log2 e - 0.5
  const vec r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  vec p = splat(1.f / 720);
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;  // 2^n
  vec scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  vec e = p * scale;
  return x < -87.f ? vec{} : e;
}

// `floats` floats from p asked into the caches (LEVEL 1: L1, prefetcht0; 2: L2, prefetcht1); speed only
template <int LEVEL>
static inline void prefetch_bytes(const float* p, int64_t floats) {
  const char* b = reinterpret_cast<const char*>(p);
  for (int64_t x = 0; x < floats * int64_t(sizeof(float)); x += 64) __builtin_prefetch(b + x, 0, 4 - LEVEL);
}

// Where a chunk's c-th key row is: its keys gathered from anywhere in the cache, or a run of consecutive cache rows
// (a context's prefix) read at a fixed stride. Both give the same loads, so the same bits.
// prefetch<LEVEL>(c0, count): rows c0.. asked for ahead of their loads (a chunk's keys and values cross a 4 KB page
// every 16 rows at D 64, where the hardware's stream prefetch starts again). Consecutive rows may be asked past the
// chunk's end (the next chunk's keys, which the thread's next task reads; a prefetch never faults), gathered ones
// only up to it.
struct Gathered {
  const float* base;
  const int64_t* keys;
  int64_t D, n;
  const float* operator()(int64_t c) const { return base + keys[c] * D; }
  template <int LEVEL>
  void prefetch(int64_t c0, int64_t count) const {
    for (int64_t c = c0; c < std::min(c0 + count, n); c++) prefetch_bytes<LEVEL>((*this)(c), D);
  }
};
struct Consecutive {
  const float* first;
  int64_t D;
  const float* operator()(int64_t c) const { return first + c * D; }
  template <int LEVEL>
  void prefetch(int64_t c0, int64_t count) const {
    prefetch_bytes<LEVEL>(first + c0 * D, count * D);
  }
};
constexpr int64_t KEYS_AHEAD = 48;  // key rows asked into L1 ahead of the block being scored (12 KB at D 64)

// q . k over d: VL lanes over d (then the lanes in lanes_sum's order), the tail after them
static inline float dot(const float* q, const float* k, int64_t D) {
  vec acc{};
  int64_t d = 0;
  for (; d + VL <= D; d += VL) acc = fmadd(loadu(q + d), loadu(k + d), acc);
  float sum = lanes_sum(acc);
  for (; d < D; d++) sum = std::fma(q[d], k[d], sum);
  return sum;
}

// VL keys' dots at once, out[j] = dot(q, row(c + j), NV * VL) bit for bit: each key's VL lanes accumulated over d as
// `dot` does (q's NV vectors held in registers), then all VL keys' lanes summed by one butterfly whose additions per
// key are lanes_sum's (lanes i and i + VL/2, then i and i + 4 of those, then (0 + 2) + (1 + 3)): no horizontal sum
// per key.
template <int NV, class Row>
static inline vec block_dots(const float* q, Row row, int64_t c0) {
  vec a[VL];
  if constexpr (NV + VL <= (VL == 16 ? 28 : 12)) {  // q and the VL keys' sums in registers (of 32 or 16)
    vec qv[NV];
    for (int i = 0; i < NV; i++) qv[i] = loadu(q + i * VL);
    for (int j = 0; j < VL; j++) a[j] = vec{};
    // each key's chain over d as above, the VL chains interleaved (a chain at a time waits on each multiply-add)
#pragma GCC unroll 16
    for (int i = 0; i < NV; i++)
#pragma GCC unroll 16
      for (int j = 0; j < VL; j++) a[j] = fmadd(qv[i], loadu(row(c0 + j) + i * VL), a[j]);
  } else {  // too few registers for that: q's vectors in turn, every key's sums
    for (int j = 0; j < VL; j++) a[j] = vec{};
    for (int i = 0; i < NV; i++) {
      const vec qd = loadu(q + i * VL);
      for (int j = 0; j < VL; j++) a[j] = fmadd(qd, loadu(row(c0 + j) + i * VL), a[j]);
    }
  }
#ifdef __AVX512F__
  vec b[8], c[4], e[2];
  for (int m = 0; m < 8; m++)  // lanes l and l + 8: [key 2m | key 2m + 1], 8 partials each
    b[m] = __builtin_shufflevector(a[2 * m], a[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * m], a[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int m = 0; m < 4; m++)  // l and l + 4: [key 4m | 4m + 2 | 4m + 1 | 4m + 3], 4 partials each
    c[m] = __builtin_shufflevector(b[2 * m], b[2 * m + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * m], b[2 * m + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int m = 0; m < 2; m++)  // (0 + 2), (1 + 3): keys 8m + [0, 4, 2, 6, 1, 5, 3, 7], 2 partials each
    e[m] = __builtin_shufflevector(c[2 * m], c[2 * m + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(c[2 * m], c[2 * m + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  const vec f = __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
                __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  return __builtin_shufflevector(f, f, 0, 4, 2, 6, 1, 5, 3, 7, 8, 12, 10, 14, 9, 13, 11, 15);  // key order
#else
  vec c[4], e[2];
  for (int m = 0; m < 4; m++)  // l and l + 4: [key 2m | key 2m + 1], 4 partials each
    c[m] = __builtin_shufflevector(a[2 * m], a[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2 * m], a[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int m = 0; m < 2; m++)  // (0 + 2), (1 + 3): keys 4m + [0, 2, 1, 3], 2 partials each
    e[m] = __builtin_shufflevector(c[2 * m], c[2 * m + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(c[2 * m], c[2 * m + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  const vec f = __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14) +
                __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15);
  return __builtin_shufflevector(f, f, 0, 2, 1, 3, 4, 6, 5, 7);  // key order
#endif
}

// out + h * ostride = sum_c p[h * pstride + c] row(c)[d0 * VL ..] in c order for HC heads and NB of the D / VL
// vectors: each key's NB value vectors loaded once for the HC heads, the HC * NB sums in registers (both counts known
// at compile time, so that no sum lives on the stack).
template <int NB, int HC, class Row>
static inline void weighted_block(const float* p, int64_t pstride, Row row, int64_t n, int d0, float* out,
                                  int64_t ostride) {
  vec acc[HC][NB] = {};
  for (int64_t c = 0; c < n; c++) {
    const float* vj = row(c) + d0 * VL;
    vec vv[NB];
    for (int i = 0; i < NB; i++) vv[i] = loadu(vj + i * VL);
    for (int hh = 0; hh < HC; hh++) {
      const vec ph = splat(p[hh * pstride + c]);
      for (int i = 0; i < NB; i++) acc[hh][i] = fmadd(ph, vv[i], acc[hh][i]);
    }
  }
  for (int hh = 0; hh < HC; hh++)
    for (int i = 0; i < NB; i++) storeu(out + hh * ostride + (d0 + i) * VL, acc[hh][i]);
}

// weighted_block over the query heads of one key/value head (D = NV * VL) in blocks of at most CH heads by NB
// vectors: CH * NB sums, NB values and a splat fit AVX2's 16 registers or AVX-512's 32. Every output value is the
// same sum in c order whatever the blocks.
template <int NV, class Row>
void weighted_sums(const float* p, int64_t pstride, int64_t heads, Row row, int64_t n, float* out, int64_t ostride) {
  constexpr int NB = NV < 4 ? NV : 4;
  constexpr int CH = std::min(4, ((VL == 16 ? 32 : 16) - 1 - NB) / NB);
  for (int64_t h0 = 0; h0 < heads; h0 += CH) {
    const float* ph = p + h0 * pstride;
    float* oh = out + h0 * ostride;
    for (int d0 = 0; d0 < NV; d0 += NB) switch (std::min<int64_t>(CH, heads - h0)) {
        case 1: weighted_block<NB, 1>(ph, pstride, row, n, d0, oh, ostride); break;
        case 2: weighted_block<NB, 2>(ph, pstride, row, n, d0, oh, ostride); break;
        case 3: if constexpr (CH >= 3) weighted_block<NB, 3>(ph, pstride, row, n, d0, oh, ostride); break;
        default: if constexpr (CH >= 4) weighted_block<NB, 4>(ph, pstride, row, n, d0, oh, ostride); break;
      }
  }
}

// The same for any D, accumulated in memory: out[D] = sum_c p[c] row(c) in c order.
template <class Row>
void weighted_sum(const float* p, Row row, int64_t n, float* out, int64_t D) {
  std::fill(out, out + D, 0.f);
  for (int64_t c = 0; c < n; c++) {
    const float* vj = row(c);
    int64_t d = 0;
    for (; d + VL <= D; d += VL) storeu(out + d, fmadd(splat(p[c]), loadu(vj + d), loadu(out + d)));
    for (; d < D; d++) out[d] = std::fma(p[c], vj[d], out[d]);
  }
}

// One chunk of a row's keys (n of them, their rows given by krow and vrow, their mask values `added`) for the G query
// heads q(hh) of one key/value head: per head, its scores' max (top[hh]), the sum of exp(score - max) (total[hh],
// VL lanes by key then lanes_sum) and o[hh * ostride + d] = sum_c exp(score_c - max) v_c[d] in key order.
// s: scratch of G * sstride floats.
template <int NV, class Row>
void attend_chunk(const float* const* q, int64_t G, Row krow, Row vrow, const float* added, int64_t n, float sc,
                  int64_t D, float* s, int64_t sstride, float* top, float* total, float* o, int64_t ostride) {
  for (int64_t hh = 0; hh < G; hh++) std::copy(added, added + n, s + hh * sstride);
  int64_t c = 0;
  krow.template prefetch<1>(0, KEYS_AHEAD);
  if constexpr (NV > 0) {
    for (; c + VL <= n; c += VL) {
      // keys KEYS_AHEAD rows on into L1, this block's values (read after the softmax) into L2
      krow.template prefetch<1>(c + KEYS_AHEAD, VL);
      vrow.template prefetch<2>(c, VL);
      for (int64_t hh = 0; hh < G; hh++) {  // dot * scale + mask in one rounding, as the tail below
        float* sh = s + hh * sstride;
        storeu(sh + c, fmadd(block_dots<NV>(q[hh], krow, c), splat(sc), loadu(sh + c)));
      }
    }
  }
  vrow.template prefetch<2>(c, n - c);
  for (; c < n; c++)
    for (int64_t hh = 0; hh < G; hh++) s[hh * sstride + c] = std::fma(dot(q[hh], krow(c), D), sc, s[hh * sstride + c]);
  const int64_t full = n / VL * VL;
  for (int64_t hh = 0; hh < G; hh++) {
    float* sh = s + hh * sstride;
    vec tops = splat(-std::numeric_limits<float>::infinity());
    for (c = 0; c < full; c += VL) tops = vmax(tops, loadu(sh + c));
    float t = lanes_max(tops);
    for (c = full; c < n; c++) t = std::max(t, sh[c]);
    vec lanes{};
    for (c = 0; c < full; c += VL) {
      const vec p = exp_nonpositive(loadu(sh + c) - t);
      storeu(sh + c, p);
      lanes += p;
    }
    if (full < n) {  // the last keys; lanes past n add exp(-1e30) = 0
      vec x;
      for (int l = 0; l < VL; l++) x[l] = full + l < n ? sh[full + l] - t : -1e30f;
      const vec p = exp_nonpositive(x);
      storeu(sh + full, p);
      lanes += p;
    }
    top[hh] = t;
    total[hh] = lanes_sum(lanes);
  }
  if constexpr (NV == 4 || NV == 8)
    weighted_sums<NV>(s, sstride, G, vrow, n, o, ostride);
  else
    for (int64_t hh = 0; hh < G; hh++) weighted_sum(s + hh * sstride, vrow, n, o + hh * ostride, D);
}

// attend_chunk on the chunk's keys as they lie: a run of consecutive cache rows (read at a fixed stride) or gathered
template <int NV>
void attend_chunk_at(const float* const* q, int64_t G, const float* kg, const float* vg, const int64_t* keys,
                     const float* added, int64_t n, float sc, int64_t D, float* s, int64_t sstride, float* top,
                     float* total, float* o, int64_t ostride) {
  if (keys[n - 1] - keys[0] == n - 1)  // ascending and distinct: consecutive
    attend_chunk<NV>(q, G, Consecutive{kg + keys[0] * D, D}, Consecutive{vg + keys[0] * D, D}, added, n, sc, D, s,
                     sstride, top, total, o, ostride);
  else
    attend_chunk<NV>(q, G, Gathered{kg, keys, D, n}, Gathered{vg, keys, D, n}, added, n, sc, D, s, sstride, top,
                     total, o, ostride);
}

// n elements of scratch, left uninitialised (each is written before it is read)
template <class T>
static std::unique_ptr<T[]> uninitialized(int64_t n) {
  return std::unique_ptr<T[]>(new T[n]);
}

// A row's allowed keys in cache order (keys[0..n)) and their mask values (added), n returned: with an additive mask
// (additive, L values) those above BLOCKED; with a bool one those set; with none (causal) 0..last. keys and added
// take L + VL values (whole vectors are stored past the last allowed key).
static int64_t allowed_keys(const float* additive, const bool* allowed, int64_t L, int64_t last, int64_t* keys,
                            float* added) {
  int64_t n = 0, j = 0;
  if (additive) {
#ifdef __AVX512F__
    const __m512i lanes_lo = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i lanes_hi = _mm512_setr_epi64(8, 9, 10, 11, 12, 13, 14, 15);
    for (; j + 16 <= L; j += 16) {  // 16 keys at a time, the allowed ones packed to the front of each vector
      const __m512 a = _mm512_loadu_ps(additive + j);
      const __mmask16 k = _mm512_cmp_ps_mask(a, _mm512_set1_ps(BLOCKED), _CMP_GT_OQ);
      const __m512i at = _mm512_set1_epi64(j);
      const int low = __builtin_popcount(k & 0xff);
      _mm512_storeu_ps(added + n, _mm512_maskz_compress_ps(k, a));
      _mm512_storeu_si512(keys + n, _mm512_maskz_compress_epi64(__mmask8(k), _mm512_add_epi64(at, lanes_lo)));
      _mm512_storeu_si512(keys + n + low,
                          _mm512_maskz_compress_epi64(__mmask8(k >> 8), _mm512_add_epi64(at, lanes_hi)));
      n += __builtin_popcount(k);
    }
#endif
    for (; j < L; j++) keys[n] = j, added[n] = additive[j], n += additive[j] > BLOCKED;
  } else {
    for (; j < L; j++) keys[n] = j, added[n] = 0.f, n += allowed ? allowed[j] : j <= last;
  }
  return n;
}

at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == 1 && k.size(0) == 1 && v.size(0) == 1,
              "eagle::row_attention takes q [1, Hq, M, D], k and v [1, Hkv, L, D] (got ", q.sizes(), ", ", k.sizes(),
              ", ", v.sizes(), ")");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "eagle::row_attention takes float32 q, k, v");
  const int64_t H = q.size(1), M = q.size(2), D = q.size(3), Hkv = k.size(1), L = k.size(2);
  TORCH_CHECK(k.size(3) == D && v.size(3) == D && v.size(2) == L && v.size(1) == Hkv && H % Hkv == 0,
              "eagle::row_attention: shapes do not match (q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), ")");
  // q as the graph passes it (a transposed view of the projection: [1, M, Hq, D] with heads and rows swapped): read
  // in place where each head's D values are contiguous
  const at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  const int64_t qhs = qc.stride(1), qrs = qc.stride(2);  // head and row strides
  // k and v as the cache holds them (a view of the first L rows of its buffers): read in place where each row's D
  // values are contiguous
  const at::Tensor kc = k.stride(3) == 1 && k.stride(2) == D ? k : k.contiguous();
  const at::Tensor vc = v.stride(3) == 1 && v.stride(2) == D ? v : v.contiguous();
  const int64_t khs = kc.stride(1), vhs = vc.stride(1);  // head strides
  at::Tensor mc;
  if (mask.has_value() && mask->defined()) {
    mc = mask->contiguous();
    TORCH_CHECK(mc.dim() == 4 && mc.size(0) == 1 && mc.size(1) == 1 && mc.size(2) == M && mc.size(3) >= L &&
                    (mc.scalar_type() == at::kFloat || mc.scalar_type() == at::kBool),
                "eagle::row_attention: mask must be float32 (additive) or bool [1, 1, M, >= L], got ", mc.sizes(),
                " ", mc.scalar_type());
  }
  at::Tensor out = at::empty({1, M, H, D}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t lm = mc.defined() ? mc.size(3) : 0;
  const bool additive = mc.defined() && mc.scalar_type() == at::kFloat;
  const float* mf = additive ? mc.data_ptr<float>() : nullptr;
  const bool* mb = mc.defined() && !additive ? mc.data_ptr<bool>() : nullptr;
  const float sc = static_cast<float>(scale);
  // each row's allowed keys, in cache order, and their mask values (shared by the row's heads); causal (no mask):
  // j <= L - M + i. Row i's keys are split in chunks of `size[i]` keys (a multiple of VL; its key count alone
  // decides it) and each chunk is a task per key/value head: chunks(i) * Hkv tasks, numbered from first[i].
  std::vector<int64_t> count(M), chunks(M), size(M), first(M + 1);
  const auto keys = uninitialized<int64_t>(M * L + VL);  // VL more: allowed_keys stores whole vectors
  const auto added = uninitialized<float>(M * L + VL);
  for (int64_t i = 0; i < M; i++) {
    const int64_t n = count[i] = allowed_keys(mf ? mf + i * lm : nullptr, mb ? mb + i * lm : nullptr, L, L - M + i,
                                              keys.get() + i * L, added.get() + i * L);
    const int64_t parts = std::max<int64_t>(1, (n + CHUNK - 1) / CHUNK);
    size[i] = std::max<int64_t>(VL, ((n + parts - 1) / parts + VL - 1) / VL * VL);
    chunks[i] = std::max<int64_t>(1, (n + size[i] - 1) / size[i]);
    first[i + 1] = first[i] + chunks[i] * Hkv;
  }
  const int64_t G = H / Hkv, sstride = CHUNK + VL, ostride = D + VL, slots = first[M];
  // per (row, key/value head, chunk) slot and query head: the chunk's max score, its sum of exponentials, its
  // unnormalised output
  const auto tops = uninitialized<float>(slots * G), totals = uninitialized<float>(slots * G),
             outs = uninitialized<float>(slots * G * ostride);
  const auto slot_of = [&](int64_t i, int64_t g, int64_t j) { return first[i] + g * chunks[i] + j; };
  // Rows whose chunk j is row 0's (the same keys and mask values: a tree's rows over their shared prefix) share one
  // task per key/value head, which reads each key and value row once for all of them (each row's arithmetic is the
  // one it has alone: a key's dot, a row's softmax and its sums do not depend on the other query vectors of a task).
  // Row 0's chunk j with the rows that share it (row 0 first), then every other (row, chunk) alone.
  auto same_chunk = [&](int64_t i, int64_t j) {
    const int64_t c0 = j * size[0], n = std::min(count[0] - c0, size[0]);
    return j < chunks[i] && size[i] == size[0] && std::min(count[i] - c0, size[i]) == n &&
           std::equal(&keys[i * L + c0], &keys[i * L + c0 + n], &keys[c0]) &&
           std::equal(&added[i * L + c0], &added[i * L + c0 + n], &added[c0]);
  };
  std::vector<int64_t> rows_of;                        // tasks' rows, one task after another
  std::vector<std::pair<int64_t, int64_t>> groups;     // (first index in rows_of, chunk j): a task per key/value head
  std::vector<char> grouped(M * chunks[0], 0);         // (row, chunk of row 0) done by row 0's task
  for (int64_t j = 0; j < chunks[0]; j++) {
    groups.emplace_back(rows_of.size(), j);
    rows_of.push_back(0);
    for (int64_t i = 1; i < M; i++)
      if (count[0] > 0 && same_chunk(i, j)) rows_of.push_back(i), grouped[i * chunks[0] + j] = 1;
  }
  for (int64_t i = 1; i < M; i++)
    for (int64_t j = 0; j < chunks[i]; j++)
      if (j >= chunks[0] || !grouped[i * chunks[0] + j]) groups.emplace_back(rows_of.size(), j), rows_of.push_back(i);
  groups.emplace_back(rows_of.size(), 0);  // the end of the last task's rows
  // A task's work: its rows x its chunk's keys. A group of many rows (a tree's over their shared context) is split
  // in tasks of at most an eighth of a thread's share, so that contiguous runs of tasks split evenly between the
  // threads; how a chunk's rows are split in tasks changes no row's arithmetic.
  const auto keys_of = [&](int64_t t) {
    const int64_t i0 = rows_of[groups[t].first], j = groups[t].second;
    return std::max<int64_t>(1, std::min(count[i0] - j * size[i0], size[i0]));
  };
  {
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    double all = 0;
    for (size_t t = 0; t + 1 < groups.size(); t++)
      all += double(groups[t + 1].first - groups[t].first) * keys_of(t) * Hkv;
    const double most = std::max(1.0, all / (8.0 * threads));
    std::vector<std::pair<int64_t, int64_t>> split;
    for (size_t t = 0; t + 1 < groups.size(); t++) {
      const int64_t R = groups[t + 1].first - groups[t].first, keys_in = keys_of(t);
      const int64_t pieces = std::min<int64_t>(R, std::max<int64_t>(1, int64_t(std::ceil(R * keys_in / most))));
      for (int64_t p = 0; p < pieces; p++) split.emplace_back(groups[t].first + R * p / pieces, groups[t].second);
    }
    split.push_back(groups.back());
    groups.swap(split);
  }
  // the tasks (key/value head g, group t), g-major as the cache lies, split in contiguous runs of about equal work
  // between the threads: a thread reads each head's keys and values as one stream. Which thread runs a task changes
  // no result.
  const int64_t ngroups = groups.size() - 1, ntasks = ngroups * Hkv;
  std::vector<double> upto(ntasks + 1, 0.0);  // work before each task
  for (int64_t task = 0; task < ntasks; task++) {
    const int64_t t = task % ngroups;
    upto[task + 1] = upto[task] + double(groups[t + 1].first - groups[t].first) * keys_of(t);
  }
  const int64_t parts = std::min<int64_t>(ntasks, at::get_num_threads());
  at::parallel_for(0, parts, 1, [&](int64_t pbegin, int64_t pend) {
    const auto s = uninitialized<float>(M * G * sstride), top = uninitialized<float>(M * G),
               total = uninitialized<float>(M * G), o = uninitialized<float>(M * G * ostride);
    std::vector<const float*> qh(M * G);
    // this call's tasks: those whose work starts in [pbegin, pend) / parts of the whole
    const auto first_task = [&](int64_t part) {
      return std::lower_bound(upto.begin(), upto.end() - 1, upto[ntasks] * part / parts) - upto.begin();
    };
    for (int64_t task = first_task(pbegin); task < (pend == parts ? ntasks : first_task(pend)); task++) {
      const int64_t g = task / ngroups, t = task % ngroups, j = groups[t].second;
      const int64_t* rows = rows_of.data() + groups[t].first;
      const int64_t R = groups[t + 1].first - groups[t].first, i0 = rows[0];
      const int64_t c0 = j * size[i0], n = std::min(count[i0] - c0, size[i0]);
      for (int64_t r = 0; r < R; r++)
        for (int64_t hh = 0; hh < G; hh++) qh[r * G + hh] = qp + (g * G + hh) * qhs + rows[r] * qrs;
      const int64_t* ks = keys.get() + i0 * L + c0;
      const float* as = added.get() + i0 * L + c0;
      const float *kg = kp + g * khs, *vg = vp + g * vhs;
      const int64_t QV = R * G;  // the task's query vectors: its rows' heads of key/value head g
      float *sp = s.get(), *tp = top.get(), *lp = total.get(), *op_ = o.get();
      if (n <= 0)  // no key to see (never in the engine: every row sees itself): zeros
        std::fill_n(tp, QV, 0.f), std::fill_n(lp, QV, 1.f), std::fill_n(op_, QV * ostride, 0.f);
      else if (D == 4 * VL)
        attend_chunk_at<4>(qh.data(), QV, kg, vg, ks, as, n, sc, D, sp, sstride, tp, lp, op_, ostride);
      else if (D == 8 * VL)
        attend_chunk_at<8>(qh.data(), QV, kg, vg, ks, as, n, sc, D, sp, sstride, tp, lp, op_, ostride);
      else if (D == 16 * VL)  // 128 with AVX2's 8 lanes
        attend_chunk_at<16>(qh.data(), QV, kg, vg, ks, as, n, sc, D, sp, sstride, tp, lp, op_, ostride);
      else
        attend_chunk_at<0>(qh.data(), QV, kg, vg, ks, as, n, sc, D, sp, sstride, tp, lp, op_, ostride);
      for (int64_t r = 0; r < R; r++) {  // each row's results to its own slot
        const int64_t slot = slot_of(rows[r], g, j);
        std::copy_n(tp + r * G, G, tops.get() + slot * G);
        std::copy_n(lp + r * G, G, totals.get() + slot * G);
        std::copy_n(op_ + r * G * ostride, G * ostride, outs.get() + slot * G * ostride);
      }
    }
  });
  // out = sum_j e_j o_j / sum_j e_j total_j over a row's chunks in order, e_j = exp(top_j - max_j top_j): with one
  // chunk (e = 1) exactly o / total
  const int64_t most = *std::max_element(chunks.begin(), chunks.end());
  at::parallel_for(0, M * H, std::max<int64_t>(1, 16384 / (most * D)), [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t ih = begin; ih < end; ih++) {
      const int64_t i = ih / H, h = ih % H, g = h / G, hh = h % G;
      const int64_t t0 = slot_of(i, g, 0);
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < chunks[i]; j++) best = std::max(best, tops[(t0 + j) * G + hh]);
      float sum = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < chunks[i]; j++) {
        const float e = std::exp(tops[(t0 + j) * G + hh] - best);
        const float* oj = outs.get() + ((t0 + j) * G + hh) * ostride;
        sum = std::fma(e, totals[(t0 + j) * G + hh], sum);
        for (int64_t d = 0; d < D; d++) acc[d] = std::fma(e, oj[d], acc[d]);
      }
      float* oi = op + (i * H + h) * D;
      for (int64_t d = 0; d < D; d++) oi[d] = acc[d] / sum;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) { m.impl("row_attention", row_attention); }
