// eagle::quant_panel_linear(x, panels, bias, out_features, qtype): out[..., N] = x[..., K] . W[N, K]^T (+ bias) in
// float32, for the 1 to 16 rows of a decode step or a tree verification, with W kept in its GGUF blocks (Q4_1 or
// Q8_0, 32 weights a block) and multiplied as integers; built with panel_linear.cpp into one library
// (eagle/model/panel_kernel.py), packed by eagle/model/quant_panels.py.
//
// Arithmetic, per row m and GGUF block b (32 consecutive k) of column j:
//   the row's 32 inputs are rounded to int16 against their largest magnitude: x ~ s[m, b] * xq, |xq| <= 32767;
//   isum = sum_k q[k, j] * xq[m, k], exact in int32 (|isum| <= 32 * 128 * 32767 < 2^31) by 16-bit dot products
//   (vpdpwssd, or vpmaddwd + vpaddd), two k a lane;
//   Q4_1 (w = d * q + m): acc += (float(isum) * s[m, b]) * d[b, j], then acc += sx[m, b] * m[b, j], where sx is the
//   float32 sum of the block's 32 inputs; Q8_0 (w = d * q): the first term only.
// Invariants:
// - The weights are exactly gguf-py's (q, d and m as stored); only the inputs are rounded, to 16 bits a block
//   (|x - s * xq| <= s / 2 * (1 + 2^-8), s = max |x| / 32767), the bound the tests hold the kernel to.
// - A row's result depends on that row alone: the same operations in the same order whatever the number of rows
//   and however they are tiled (batch-invariant), so a verify pass gives each row what a one-row step gives it.
//
// Layout of a panel (NB = 2 * VL columns, zero columns past N), block after block (K / 32 of them):
//   Q4_1: d[NB] fp16, m[NB] fp16, then 4 groups of 8 k, each NB uint32: the word of column j holds the group's 8 q
//         as nibbles, k + 2p in bits 4p..4p+3 and k + 2p + 1 in bits 16+4p..19+4p, so (word >> 4p) & 0x000F000F
//         is the int16 pair (q[k + 2p], q[k + 2p + 1]);
//   Q8_0: d[NB] fp16, then 16 k-pairs x NB int8 pairs (q[2i][j], q[2i + 1][j]).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

constexpr int64_t Q4_1 = 3, Q8_0 = 8;  // ggml's type numbers (gguf.GGMLQuantizationType)
constexpr int QK = 32;                 // weights per block

#ifdef __AVX512F__
constexpr int VL = 16;
typedef __m512 vf;
typedef __m512i vi;
static inline vf from_fp16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
static inline vi load(const uint8_t* p) { return _mm512_loadu_si512(p); }
static inline vi s8pairs(const uint8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
static inline vi nibble_pairs(vi w, int p) { return _mm512_and_si512(_mm512_srli_epi32(w, 4 * p), _mm512_set1_epi32(0x000F000F)); }
static inline vi bcast32(const int16_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
#ifdef __AVX512VNNI__
static inline vi dot(vi acc, vi a, vi b) { return _mm512_dpwssd_epi32(acc, a, b); }
#else
static inline vi dot(vi acc, vi a, vi b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
#endif
static inline vi izero() { return _mm512_setzero_si512(); }
static inline vf tofloat(vi a) { return _mm512_cvtepi32_ps(a); }
static inline vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf bcast(float a) { return _mm512_set1_ps(a); }
static inline vf zero() { return _mm512_setzero_ps(); }
static inline void store(float* p, vf a) { _mm512_storeu_ps(p, a); }
// the vectors of columns (NV) a tile of `rows` rows holds: rows x NV int32 sums in registers through a block, the
// float32 sums touched once a block
constexpr int nv_for(int rows) { return rows <= 2 ? 4 : 2; }
constexpr int MR = 8;  // rows of a tile at most
#else
constexpr int VL = 8;
typedef __m256 vf;
typedef __m256i vi;
static inline vf from_fp16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
static inline vi load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline vi s8pairs(const uint8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)); }
static inline vi nibble_pairs(vi w, int p) { return _mm256_and_si256(_mm256_srli_epi32(w, 4 * p), _mm256_set1_epi32(0x000F000F)); }
static inline vi bcast32(const int16_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
#ifdef __AVXVNNI__
static inline vi dot(vi acc, vi a, vi b) { return _mm256_dpwssd_avx_epi32(acc, a, b); }
#else
static inline vi dot(vi acc, vi a, vi b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
#endif
static inline vi izero() { return _mm256_setzero_si256(); }
static inline vf tofloat(vi a) { return _mm256_cvtepi32_ps(a); }
static inline vf fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf bcast(float a) { return _mm256_set1_ps(a); }
static inline vf zero() { return _mm256_setzero_ps(); }
static inline void store(float* p, vf a) { _mm256_storeu_ps(p, a); }
constexpr int nv_for(int rows) { return rows <= 2 ? 2 : 1; }
constexpr int MR = 4;  // tiles of 8 rows spill the 16 registers (BENCHMARKS.md, the 4-bit section)
#endif
constexpr int NB = 2 * VL;  // columns of a panel
constexpr int64_t block_bytes(int64_t qtype) { return qtype == Q4_1 ? 20 * NB : 34 * NB; }
// A panel's blocks this many bytes ahead are prefetched into L1 at each block (the hardware prefetcher alone
// left one row streaming below the machine's bandwidth; a prefetch past the end never faults).
constexpr int64_t PREFETCH = 16384;

// The rows' inputs as the kernel multiplies them: xq [M, K] int16, s and (Q4_1) sx [M, K / 32] float32.
struct Inputs {
  const int16_t* xq;
  const float* s;
  const float* sx;
  int64_t K;
};

// x [M, K] float32 -> xq, s, sx (see the file's head): per row and block, s = max |x| / 32767 and
// xq = round-to-nearest-even(x * (32767 / max |x|)), 0 where the block is 0.
void quantize_rows(const float* x, int64_t M, int64_t K, int16_t* xq, float* s, float* sx) {
  for (int64_t m = 0; m < M; m++)
    for (int64_t b = 0; b < K / QK; b++) {
      const float* xb = x + m * K + b * QK;
      float amax = 0.f, sum = 0.f;
      for (int k = 0; k < QK; k++) amax = std::max(amax, std::fabs(xb[k]));
      for (int k = 0; k < QK; k++) sum += xb[k];
      const float inv = amax > 0.f ? 32767.f / amax : 0.f;
      for (int k = 0; k < QK; k++)
        xq[m * K + b * QK + k] = static_cast<int16_t>(std::clamp(std::nearbyint(xb[k] * inv), -32767.f, 32767.f));
      s[m * (K / QK) + b] = amax / 32767.f;
      sx[m * (K / QK) + b] = sum;
    }
}

// ROWS x (NV * VL) outputs of consecutive panels (panel stride `pstride` bytes) from the h0-th vector of columns
// of the first (0 or 1); out [ROWS, ncols] (row stride ldo) from that column.
template <int64_t QT, int ROWS, int NV>
void tile(const Inputs& in, const uint8_t* panel, int64_t pstride, float* out, int64_t ldo, const float* bias,
          int ncols, int h0) {
  constexpr int NP = (NV + 1) / 2;  // panels read (at h0 = 0)
  constexpr int64_t BS = block_bytes(QT);
  const int64_t K = in.K, nblocks = K / QK;
  vf acc[ROWS][NV];
  for (int m = 0; m < ROWS; m++)
    for (int v = 0; v < NV; v++) acc[m][v] = zero();
  for (int64_t b = 0; b < nblocks; b++) {
    for (int p = 0; p < NP; p++)
      for (int64_t i = 0; i < BS; i += 64) __builtin_prefetch(panel + p * pstride + b * BS + PREFETCH + i, 0, 3);
    const uint8_t* blk[NV];  // the block of vector v's panel, and the vector's offset in it (columns)
    int col[NV];
    for (int v = 0; v < NV; v++) blk[v] = panel + ((h0 + v) / 2) * pstride + b * BS, col[v] = ((h0 + v) % 2) * VL;
    const int16_t* xb = in.xq + b * QK;
    vi isum[ROWS][NV];
    for (int m = 0; m < ROWS; m++)
      for (int v = 0; v < NV; v++) isum[m][v] = izero();
    if constexpr (QT == Q4_1) {
      for (int g = 0; g < QK / 8; g++) {
        vi words[NV];
        for (int v = 0; v < NV; v++) words[v] = load(blk[v] + 4 * NB + (g * NB + col[v]) * 4);
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
          vi w[NV];
          for (int v = 0; v < NV; v++) w[v] = nibble_pairs(words[v], p);
#pragma GCC unroll 8
          for (int m = 0; m < ROWS; m++) {
            const vi xp = bcast32(xb + m * K + 8 * g + 2 * p);
            for (int v = 0; v < NV; v++) isum[m][v] = dot(isum[m][v], w[v], xp);
          }
        }
      }
    } else {
#pragma GCC unroll 4
      for (int i = 0; i < QK / 2; i++) {
        vi w[NV];
        for (int v = 0; v < NV; v++) w[v] = s8pairs(blk[v] + 2 * NB + (i * NB + col[v]) * 2);
#pragma GCC unroll 8
        for (int m = 0; m < ROWS; m++) {
          const vi xp = bcast32(xb + m * K + 2 * i);
          for (int v = 0; v < NV; v++) isum[m][v] = dot(isum[m][v], w[v], xp);
        }
      }
    }
    for (int v = 0; v < NV; v++) {
      const vf d = from_fp16(reinterpret_cast<const uint16_t*>(blk[v]) + col[v]);
      for (int m = 0; m < ROWS; m++) acc[m][v] = fma(mul(tofloat(isum[m][v]), bcast(in.s[m * nblocks + b])), d, acc[m][v]);
      if constexpr (QT == Q4_1) {
        const vf mn = from_fp16(reinterpret_cast<const uint16_t*>(blk[v] + 2 * NB) + col[v]);
        for (int m = 0; m < ROWS; m++) acc[m][v] = fma(bcast(in.sx[m * nblocks + b]), mn, acc[m][v]);
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

// tile<QT, rows, NV> for a run-time rows in 1..sizeof...(R)
template <int64_t QT, int NV, int... R>
TileFn tile_for(int rows, std::integer_sequence<int, R...>) {
  TileFn fn = nullptr;
  ((rows == R + 1 ? (fn = &tile<QT, R + 1, NV>, 0) : 0), ...);
  return fn;
}

template <int64_t QT>
TileFn tile_of(int rows, int nv) {
  if (nv == 4) return tile_for<QT, 4>(rows, std::make_integer_sequence<int, 2>{});
  if (nv == 2) return tile_for<QT, 2>(rows, std::make_integer_sequence<int, MR>{});
  return tile_for<QT, 1>(rows, std::make_integer_sequence<int, MR>{});
}

template <int64_t QT>
void run(const Inputs& in, int64_t M, const uint8_t* wp, int64_t P, int64_t N, const float* bp, float* op) {
  if (M == 0) return;
  const int64_t pstride = in.K / QK * block_bytes(QT), nblocks = in.K / QK;
  const int nv_all = nv_for(static_cast<int>(std::min<int64_t>(MR, M)));  // 4: two panels a tile
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end;) {
      const int np = (nv_all == 4 && p + 1 < end) ? 2 : 1;  // panels this step
      const int pcols = static_cast<int>(std::min<int64_t>(np * NB, N - p * NB));
      const uint8_t* panel = wp + p * pstride;
      for (int64_t m0 = 0; m0 < M; m0 += MR) {  // a panel's next tile of rows reads it from cache
        const int rows = static_cast<int>(std::min<int64_t>(MR, M - m0));
        const int nv = std::min(nv_for(rows), 2 * np);  // vectors of columns a tile covers
        const TileFn fn = tile_of<QT>(rows, nv);
        const Inputs rows_in{in.xq + m0 * in.K, in.s + m0 * nblocks, in.sx + m0 * nblocks, in.K};
        for (int h0 = 0; h0 < 2 * np && h0 * VL < pcols; h0 += nv)
          fn(rows_in, panel, pstride, op + m0 * N + p * NB + h0 * VL, N, bp ? bp + p * NB + h0 * VL : nullptr,
             std::min(nv * VL, pcols - h0 * VL), h0);
      }
      p += np;
    }
  });
}

at::Tensor quant_panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                              int64_t out_features, int64_t qtype) {
  TORCH_CHECK(qtype == Q4_1 || qtype == Q8_0, "eagle::quant_panel_linear: qtype ", qtype,
              " is not Q4_1 (3) or Q8_0 (8)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kByte,
              "eagle::quant_panel_linear takes float32 x and uint8 panels (got ", x.scalar_type(), ", ",
              panels.scalar_type(), ")");
  const int64_t K = x.size(-1), N = out_features;
  TORCH_CHECK(K % QK == 0, "eagle::quant_panel_linear: in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(panels.dim() == 2 && panels.size(1) == K / QK * block_bytes(qtype) && panels.size(0) * NB >= N &&
                  (panels.size(0) - 1) * NB < N,
              "eagle::quant_panel_linear: panels must be [ceil(N / ", NB, "), K / 32 * ", block_bytes(qtype),
              "] for this build and qtype, got ", panels.sizes(), " for x ", x.sizes(), " and N = ", N,
              "; pack the blocks with eagle.model.quant_panels.pack");
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
  std::vector<int16_t> xq(M * K);
  std::vector<float> s(M * (K / QK)), sx(M * (K / QK));
  quantize_rows(xc.data_ptr<float>(), M, K, xq.data(), s.data(), sx.data());
  const Inputs in{xq.data(), s.data(), sx.data(), K};
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  (qtype == Q4_1 ? run<Q4_1> : run<Q8_0>)(in, M, wc.data_ptr<uint8_t>(), panels.size(0), N, bp,
                                          out.data_ptr<float>());
  return out;
}

int64_t quant_panel_width() { return NB; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("quant_panel_linear(Tensor x, Tensor panels, Tensor? bias, int out_features, int qtype) -> Tensor");
  m.def("quant_panel_width() -> int");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) { m.impl("quant_panel_linear", quant_panel_linear); }
TORCH_LIBRARY_IMPL(eagle, CompositeExplicitAutograd, m) { m.impl("quant_panel_width", quant_panel_width); }
