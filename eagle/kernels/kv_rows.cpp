// eagle::compact_rows(buffers, keep, start): in each KV buffer [1, H, capacity, D] (contiguous), rows keep[i] moved
// to rows start + i, for every head; built with panel_linear.cpp into one library (eagle/kernels/panel_kernel.py), used
// by eagle/models/kv_cache.py (TreeKVCache.compact): one call for every layer instead of two copies a layer.
//
// Safe in place: keep is ascending with keep[i] >= start + i, so a row written (start + i) is never a source still
// to be read (keep[j] > keep[i] >= start + i for j > i).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstring>

namespace {

void compact_rows(at::TensorList buffers, at::IntArrayRef keep, int64_t start) {
  const int64_t n = static_cast<int64_t>(keep.size());
  for (int64_t i = 0; i < n; i++)
    TORCH_CHECK(keep[i] >= start + i && (i == 0 || keep[i] > keep[i - 1]),
                "eagle::compact_rows: keep must ascend from start (got ", keep, ", start ", start, ")");
  for (const at::Tensor& b : buffers) {
    TORCH_CHECK(b.dim() == 4 && b.size(0) == 1 && b.is_contiguous() && b.device().is_cpu(),
                "eagle::compact_rows takes contiguous CPU buffers [1, H, capacity, D], got ", b.sizes());
    TORCH_CHECK(n == 0 || keep[n - 1] < b.size(2), "eagle::compact_rows: row ", keep[n - 1], " past the capacity ",
                b.size(2));
  }
  at::parallel_for(0, static_cast<int64_t>(buffers.size()), 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      const at::Tensor& b = buffers[t];
      const int64_t H = b.size(1), rows = b.size(2), bytes = b.size(3) * b.element_size();
      char* base = static_cast<char*>(b.data_ptr());
      for (int64_t h = 0; h < H; h++) {
        char* head = base + h * rows * bytes;
        for (int64_t i = 0; i < n; i++)
          if (keep[i] != start + i) std::memmove(head + (start + i) * bytes, head + keep[i] * bytes, bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle, m) { m.def("compact_rows(Tensor(a!)[] buffers, int[] keep, int start) -> ()"); }

TORCH_LIBRARY_IMPL(eagle, CPU, m) { m.impl("compact_rows", compact_rows); }
