// eagle::quant_panel_linear(x, panels, bias, out_features, qtype): out[..., N] = x[..., K] . W[N, K]^T (+ bias) in
// float32, for the 1 to 16 rows of a decode step or a tree verification, with W kept in its GGUF blocks (Q4_1 or
// Q8_0, 32 weights a block) and dequantized in registers; built with panel_linear.cpp into one library
// (eagle/model/panel_kernel.py), packed by eagle/model/quant_panels.py.
//
// Invariants:
// - The weights are exactly the float32 values gguf-py's dequantization gives (what transformers loads):
//   Q4_1 w = d * q + m with d, m fp16 and q in 0..15: d * q is exact in float32 (11 + 4 significant bits), so
//   fma(q, d, m) rounds once the same sum that (d * q) + m rounds once. Q8_0 w = d * q, q in -128..127: exact.
// - Each output is summed over k in order, one fused multiply-add per k (acc = x[m, k] * w[k, j] + acc), then the
//   bias added: the arithmetic of an output never depends on the other rows, how many there are or how they are
//   tiled (batch-invariant), and equals the float32 panel kernel's (panel_linear.cpp) on the dequantized weights.
//
// Layout of a panel (NB = 2 * VL columns, zero columns past N), block after block (K / 32 of them):
//   Q4_1: d[NB] fp16, m[NB] fp16, then 16 k-pairs x NB bytes, byte (i, j) = q[2i][j] | q[2i + 1][j] << 4;
//   Q8_0: d[NB] fp16, then 32 k x NB int8.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

namespace {

constexpr int64_t Q4_1 = 3, Q8_0 = 8;  // ggml's type numbers (gguf.GGMLQuantizationType)
constexpr int QK = 32;                 // weights per block

#ifdef __AVX512F__
constexpr int VL = 16;
constexpr int MR = 8;      // rows of a tile past WIDE rows: 16 accumulators + scale and minimum of 2 vectors + temporaries
constexpr int NARROW = 2;  // vectors of columns of such a tile: a whole panel
constexpr int WIDE = 4;    // rows up to this take two panels a tile (4 accumulator chains a row, not 2)
typedef __m512 vf;
typedef __m512i vi;
static inline vf from_fp16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
static inline vi u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
static inline vi s8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
static inline vi low4(vi a) { return _mm512_and_si512(a, _mm512_set1_epi32(15)); }
static inline vi high4(vi a) { return _mm512_srli_epi32(a, 4); }
static inline vf tofloat(vi a) { return _mm512_cvtepi32_ps(a); }
static inline vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf bcast(float a) { return _mm512_set1_ps(a); }
static inline vf zero() { return _mm512_setzero_ps(); }
static inline void store(float* p, vf a) { _mm512_storeu_ps(p, a); }
#else
constexpr int VL = 8;
constexpr int MR = 8;      // 8 accumulators + scale and minimum of 1 vector + temporaries of the 16 registers
constexpr int NARROW = 1;  // half a panel a tile: whole-panel tiles fit 4 rows only, dequantizing each weight twice
                           // for 8 rows
constexpr int WIDE = 2;
typedef __m256 vf;
typedef __m256i vi;
static inline vf from_fp16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
static inline vi u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
static inline vi s8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
static inline vi low4(vi a) { return _mm256_and_si256(a, _mm256_set1_epi32(15)); }
static inline vi high4(vi a) { return _mm256_srli_epi32(a, 4); }
static inline vf tofloat(vi a) { return _mm256_cvtepi32_ps(a); }
static inline vf fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf bcast(float a) { return _mm256_set1_ps(a); }
static inline vf zero() { return _mm256_setzero_ps(); }
static inline void store(float* p, vf a) { _mm256_storeu_ps(p, a); }
#endif
constexpr int NB = 2 * VL;  // columns of a panel
constexpr int64_t block_bytes(int64_t qtype) { return qtype == Q4_1 ? 20 * NB : 34 * NB; }
// A panel's blocks this many bytes ahead are prefetched into L1 at each block (the hardware prefetcher alone
// left one row streaming below the machine's bandwidth; a prefetch past the end never faults).
constexpr int64_t PREFETCH = 16384;

// ROWS x (NV * VL) outputs of consecutive panels (panel stride `pstride` bytes) from the h0-th vector of columns
// of the first (0 or 1): x [ROWS, K] (row stride ldx), out [ROWS, ncols] (row stride ldo), both from that column.
// QT: Q4_1 or Q8_0.
template <int64_t QT, int ROWS, int NV>
void tile(const float* x, int64_t ldx, const uint8_t* panel, int64_t pstride, int64_t K, float* out, int64_t ldo,
          const float* bias, int ncols, int h0) {
  constexpr int NP = (NV + 1) / 2;  // panels read (at h0 = 0)
  constexpr int64_t BS = block_bytes(QT);
  vf acc[ROWS][NV];
  for (int m = 0; m < ROWS; m++)
    for (int v = 0; v < NV; v++) acc[m][v] = zero();
  for (int64_t b = 0; b < K / QK; b++) {
    const int64_t k0 = b * QK;
    for (int p = 0; p < NP; p++)
      for (int64_t i = 0; i < BS; i += 64) __builtin_prefetch(panel + p * pstride + b * BS + PREFETCH + i, 0, 3);
    vf d[NV], mn[NV];
    for (int v = 0; v < NV; v++) {
      const uint8_t* blk = panel + ((h0 + v) / 2) * pstride + b * BS;
      d[v] = from_fp16(reinterpret_cast<const uint16_t*>(blk) + ((h0 + v) % 2) * VL);
      if constexpr (QT == Q4_1)
        mn[v] = from_fp16(reinterpret_cast<const uint16_t*>(blk + 2 * NB) + ((h0 + v) % 2) * VL);
    }
    if constexpr (QT == Q4_1) {
      for (int i = 0; i < QK / 2; i++) {
        const float* xk = x + k0 + 2 * i;
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) {
          const vi q = u8(panel + ((h0 + v) / 2) * pstride + b * BS + 4 * NB + i * NB + ((h0 + v) % 2) * VL);
          const vf w0 = fma(tofloat(low4(q)), d[v], mn[v]);
          const vf w1 = fma(tofloat(high4(q)), d[v], mn[v]);
#pragma GCC unroll 16
          for (int m = 0; m < ROWS; m++) acc[m][v] = fma(bcast(xk[m * ldx]), w0, acc[m][v]);
#pragma GCC unroll 16
          for (int m = 0; m < ROWS; m++) acc[m][v] = fma(bcast(xk[m * ldx + 1]), w1, acc[m][v]);
        }
      }
    } else {
      for (int i = 0; i < QK; i++) {
        const float* xk = x + k0 + i;
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) {
          const uint8_t* q = panel + ((h0 + v) / 2) * pstride + b * BS + 2 * NB + i * NB + ((h0 + v) % 2) * VL;
          const vf w = mul(tofloat(s8(q)), d[v]);
#pragma GCC unroll 16
          for (int m = 0; m < ROWS; m++) acc[m][v] = fma(bcast(xk[m * ldx]), w, acc[m][v]);
        }
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

using TileFn = void (*)(const float*, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t, const float*,
                        int, int);

// tile<QT, rows, NV> for a run-time rows in 1..sizeof...(R)
template <int64_t QT, int NV, int... R>
TileFn tile_for(int rows, std::integer_sequence<int, R...>) {
  TileFn fn = nullptr;
  ((rows == R + 1 ? (fn = &tile<QT, R + 1, NV>, 0) : 0), ...);
  return fn;
}

template <int64_t QT>
void run(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t P, int64_t N, const float* bp,
         float* op) {
  const int64_t pstride = K / QK * block_bytes(QT);
  // few rows (one tile): two panels a tile, for more independent sums in flight than one panel's two vectors
  if (M == 0) return;
  const bool wide = M <= WIDE;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end;) {
      const int np = (wide && p + 1 < end) ? 2 : 1;
      const int pcols = static_cast<int>(std::min<int64_t>(np * NB, N - p * NB));
      const uint8_t* panel = wp + p * pstride;
      if (wide) {  // one tile of all M rows
        const TileFn fn = np == 2 ? tile_for<QT, 4>(M, std::make_integer_sequence<int, WIDE>{})
                                  : tile_for<QT, 2>(M, std::make_integer_sequence<int, WIDE>{});
        fn(xp, K, panel, pstride, K, op + p * NB, N, bp ? bp + p * NB : nullptr, pcols, 0);
      }
      for (int h0 = 0; !wide && h0 < 2 && h0 * VL < pcols; h0 += NARROW) {  // tiles of NARROW vectors
        const int ncols = std::min(NARROW * VL, pcols - h0 * VL);
        for (int64_t m0 = 0; m0 < M; m0 += MR) {  // a panel's second tile of rows reads it from cache
          const int rows = static_cast<int>(std::min<int64_t>(MR, M - m0));
          tile_for<QT, NARROW>(rows, std::make_integer_sequence<int, MR>{})(
              xp + m0 * K, K, panel, pstride, K, op + m0 * N + p * NB + h0 * VL, N,
              bp ? bp + p * NB + h0 * VL : nullptr, ncols, h0);
        }
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
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  (qtype == Q4_1 ? run<Q4_1> : run<Q8_0>)(xc.data_ptr<float>(), M, K, wc.data_ptr<uint8_t>(), panels.size(0), N,
                                          bp, out.data_ptr<float>());
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
