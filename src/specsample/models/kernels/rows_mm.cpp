// The int4 and int8 matrix products of our quantized layers (quant_core.h) as torch ops: one projection per call,
// for the layers of the torch path.

#include <torch/library.h>

#include <sys/syscall.h>
#include <unistd.h>

#include "quant_core.h"

namespace {

using specsample::bf16;
using specsample::Weight;

at::Tensor store(const at::Tensor& x, const Weight& w, bool pool) {
  auto xc = x.contiguous();
  const int64_t m = xc.size(0);
  auto out = at::empty({m, w.n}, x.options());
  bf16* result = out.data_ptr<bf16>();
  std::vector<float> sums(w.kind == Weight::INT4 ? m * (w.k / w.group) : 0);
  specsample::project(xc.data_ptr<bf16>(), m, w, sums.data(), [&](int64_t r, int64_t j0, int64_t width, const float* v) {
    for (int64_t i = 0; i < width; i += 16) {
      if (width - i >= 16)
        specsample::store_bf16(result + r * w.n + j0 + i, _mm512_loadu_ps(v + i));
      else
        for (int64_t t = i; t < width; ++t) result[r * w.n + j0 + t] = bf16(v[t]);
    }
  }, pool);
  return out;
}

at::Tensor int4_rows_mm(const at::Tensor& x, const at::Tensor& packed, int64_t group, const at::Tensor& scales_zeros,
                        bool pool) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be [m, k] bfloat16");
  Weight w = specsample::int4_weight(packed, group, scales_zeros);
  TORCH_CHECK(x.size(1) == w.k, "x's width does not match the int4 weight");
  return store(x, w, pool);
}

at::Tensor int8_rows_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, bool pool) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be [m, k] bfloat16");
  TORCH_CHECK(codes.scalar_type() == at::kChar && scales.scalar_type() == at::kBFloat16, "bad weight dtypes");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous(), "int8 weights must be contiguous");
  Weight w;
  w.kind = Weight::INT8;
  w.n = codes.size(0);
  w.k = x.size(1);
  TORCH_CHECK(codes.size(1) == w.k && scales.numel() == w.n, "shapes do not match the int8 layout");
  specsample::check_weight(w);
  w.int8_codes = codes.data_ptr<int8_t>();
  w.int8_scales = scales.data_ptr<bf16>();
  return store(x, w, pool);
}

// Asks Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM) and, where granted, runs every int4 product on
// tiles from now on; `on` false goes back to AVX-512. Returns whether tiles are in use.
bool use_amx(bool on) {
  if (on) {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    on = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }
  specsample::amx_enabled() = on;
  return on;
}

// Our pool with `threads` threads in all (the caller and threads - 1 workers); made once, on the first call.
void start_pool(int64_t threads) { specsample::Pool::start(static_cast<int>(threads)); }

}  // namespace

TORCH_LIBRARY(specsample_rows, m) {
  m.def("use_amx(bool on) -> bool", use_amx);
  m.def("int4_rows_mm(Tensor x, Tensor packed, int group, Tensor scales_zeros, bool pool=False) -> Tensor");
  m.def("int8_rows_mm(Tensor x, Tensor codes, Tensor scales, bool pool=False) -> Tensor");
  m.def("start_pool(int threads) -> ()", start_pool);
}

TORCH_LIBRARY_IMPL(specsample_rows, CPU, m) {
  m.impl("int4_rows_mm", &int4_rows_mm);
  m.impl("int8_rows_mm", &int8_rows_mm);
}
