// eagle::panel_linear(x, panels, bias, out_features): out[..., N] = x[..., K] . W[N, K]^T (+ bias) in float32,
// for the few rows of a decode step or a tree verification; built at first use with -march=native
// (eagle/kernels/panel_kernel.py).
//
// A decode-sized product is a stream of the weight: each weight element is read once and used M times (M = 1 to
// 16 rows). The weight is stored as column panels, panels[P, K, NB] with P = ceil(N / NB) and zero columns past
// N, so a panel is one contiguous stream. Each thread takes whole panels; a tile of up to MR rows keeps its
// MR x NB sums in vector registers while its panel streams past once (rows past MR take another tile over the
// same panel, then in cache). Sums run over k in order, one fused multiply-add per k and column. Prefetches
// past the end of a panel (into the next one, or past the tensor) are harmless: a prefetch never faults.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

namespace {

#ifdef __AVX512F__
constexpr int VL = 16;  // floats per vector register
constexpr int V = 3;    // vectors per panel row: NB = 48
constexpr int MR = 8;   // rows per tile: 24 accumulators + 3 weight vectors + 1 broadcast of the 32 registers
#else
constexpr int VL = 8;
constexpr int V = 2;   // NB = 16
constexpr int MR = 6;  // 12 accumulators + 1 broadcast of the 16 registers (the weights are FMA operands): with
                       // AVX2 code on a Zen 5, 8 / 16 rows 3.0 / 5.2 ms where 4 rows a tile took 3.6 / 6.9
#endif
constexpr int NB = V * VL;
// The weight rows read this far ahead are prefetched into L1: the hardware prefetcher alone left 8 rows at 1.5x
// the time of one (AMD EPYC Zen 5, 2 threads; with 12 KB ahead 1.1-1.25x, 8 to 24 KB measured alike).
constexpr int64_t PREFETCH_K = 12288 / (NB * sizeof(float));
typedef float vec __attribute__((vector_size(VL * sizeof(float))));
// the same vector at any float's address: loads and stores straight between memory and registers (a memcpy into a
// vec array made gcc's AVX2 code go through the stack, 3x slower at 8 rows)
typedef float vec_u __attribute__((vector_size(VL * sizeof(float)), aligned(4), may_alias));

// ROWS x ncols outputs of one panel: x [ROWS, K] (row stride ldx), wp [K, NB], out [ROWS, ncols] (row stride ldo)
template <int ROWS>
void tile(const float* x, int64_t ldx, const float* wp, int64_t K, float* out, int64_t ldo, const float* bias,
          int ncols) {
  vec acc[ROWS][V];
  for (int m = 0; m < ROWS; m++)
    for (int v = 0; v < V; v++) acc[m][v] = vec{};
  for (int64_t k = 0; k < K; k++) {
    for (int i = 0; i < NB; i += 64 / sizeof(float)) __builtin_prefetch(wp + (k + PREFETCH_K) * NB + i, 0, 3);
    vec w[V];
    for (int v = 0; v < V; v++) w[v] = *reinterpret_cast<const vec_u*>(wp + k * NB + v * VL);
#pragma GCC unroll 16
    for (int m = 0; m < ROWS; m++) {
      const float a = x[m * ldx + k];
      for (int v = 0; v < V; v++) acc[m][v] += a * w[v];
    }
  }
  for (int m = 0; m < ROWS; m++) {
    float row[NB];
    for (int v = 0; v < V; v++) *reinterpret_cast<vec_u*>(row + v * VL) = acc[m][v];
    if (bias)
      for (int j = 0; j < ncols; j++) row[j] += bias[j];
    std::memcpy(out + m * ldo, row, ncols * sizeof(float));
  }
}

// tile<rows> for a run-time rows in 1..MR (each count its own fully unrolled code)
template <int... R>
void tile_of(int rows, std::integer_sequence<int, R...>, const float* x, int64_t ldx, const float* wp, int64_t K,
             float* out, int64_t ldo, const float* bias, int ncols) {
  ((rows == R + 1 ? tile<R + 1>(x, ldx, wp, K, out, ldo, bias, ncols) : void()), ...);
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                        int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat,
              "eagle::panel_linear takes float32 x and panels (got ", x.scalar_type(), ", ", panels.scalar_type(),
              ")");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == NB && panels.size(1) == x.size(-1) &&
                  panels.size(0) * NB >= out_features && (panels.size(0) - 1) * NB < out_features,
              "eagle::panel_linear: panels must be [ceil(N / ", NB, "), K, ", NB, "] for this build, got ",
              panels.sizes(), " for x ", x.sizes(), " and N = ", out_features,
              "; pack the weight with eagle.kernels.panel_kernel.pack");
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = panels.contiguous();
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == out_features,
                "eagle::panel_linear: bias must be float32 of N = ", out_features, " elements");
  }
  const int64_t K = x.size(-1), M = K ? x.numel() / K : 0, N = out_features;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, panels.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++) {
      const int ncols = static_cast<int>(std::min<int64_t>(NB, N - p * NB));
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int rows = static_cast<int>(std::min<int64_t>(MR, M - m0));
        tile_of(rows, std::make_integer_sequence<int, MR>{}, xp + m0 * K, K, wp + p * K * NB, K,
                op + m0 * N + p * NB, N, bp ? bp + p * NB : nullptr, ncols);
      }
    }
  });
  return out;
}

int64_t panel_width() { return NB; }

}  // namespace

TORCH_LIBRARY(eagle, m) {
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.def("panel_width() -> int");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) { m.impl("panel_linear", panel_linear); }
TORCH_LIBRARY_IMPL(eagle, CompositeExplicitAutograd, m) { m.impl("panel_width", panel_width); }
